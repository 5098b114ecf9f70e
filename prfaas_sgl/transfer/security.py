"""CurveZMQ encryption + authentication for the data plane.

Keys directory (`TransferConfig.keys_dir`), in zmq.auth certificate format:

    KEYS_DIR/server.key, server.key_secret   receiver (decode) key pair
    KEYS_DIR/client.key, client.key_secret   sender (prefill) key pair
    KEYS_DIR/authorized_clients/*.key        public keys a receiver accepts

A receiver only completes the CURVE handshake with clients whose public key is in authorized_clients,
so a peer without an authorized key can neither connect nor inject bytes. Create a directory with
`python -m prfaas_sgl.transfer.security KEYS_DIR`; copy the client pair to prefill hosts, the server
pair to decode hosts, the public halves everywhere.
"""

from __future__ import annotations

import argparse
import os
import shutil

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED = "authorized_clients"


def generate_keys(keys_dir: str, client_name: str = "client") -> None:
    """Create server and client key pairs and authorize the client. Existing files are replaced."""
    os.makedirs(os.path.join(keys_dir, AUTHORIZED), exist_ok=True)
    zmq.auth.create_certificates(keys_dir, "server")
    public, _ = zmq.auth.create_certificates(keys_dir, client_name)
    shutil.copy(public, os.path.join(keys_dir, AUTHORIZED, f"{client_name}.key"))


def server_public_key(keys_dir: str) -> str:
    public, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    return public.decode()


def secure_server(ctx: zmq.Context, sock: zmq.Socket, keys_dir: str) -> ThreadAuthenticator:
    """Make `sock` a CURVE server that admits only authorized client keys. Call before bind()."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=os.path.join(keys_dir, AUTHORIZED))
    public, secret = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key_secret"))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket, keys_dir: str, server_key: str | None,
                  client_name: str = "client") -> None:
    """Make `sock` a CURVE client of a server with public key `server_key` (z85; default: keys_dir's)."""
    public, secret = zmq.auth.load_certificate(os.path.join(keys_dir, f"{client_name}.key_secret"))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = (server_key or server_public_key(keys_dir)).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("keys_dir")
    generate_keys(parser.parse_args().keys_dir)


if __name__ == "__main__":
    main()
