"""`prfaas keys DIR`: create the prfaas_zmq keys directory (CURVE key pairs, authorized keys, Register secret)
and the tier key that signs prfaas_hybrid's storage-tier entries (tier.secret)."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="create CURVE keys and the Register secret for --prfaas-zmq-curve-keys")
    p.add_argument("keys_dir", help="directory to create (its key files are replaced; it ends 0700, secrets 0600)")
    p.add_argument("--client-name", default="client", help="name of the sender key pair")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prfaas_sgl.cachepool.tiers.auth import KEY_FILE, write_key
    from prfaas_sgl.transfer.security import generate_keys

    try:
        generate_keys(args.keys_dir, args.client_name)
        write_key(os.path.join(args.keys_dir, KEY_FILE))
    except OSError as e:
        print(f"prfaas keys: {e}", file=sys.stderr)
        return 2
    d = args.keys_dir
    print(f"keys in {d}:\n"
          f"  prefill hosts: {args.client_name}.key_secret, {args.client_name}.key, server.key, register.secret\n"
          f"  decode hosts:  server.key_secret, server.key, authorized_clients/, register.secret\n"
          f"  secret files are 0600 in 0700 directories: keep them so when you copy (scp -p, rsync -p); a server\n"
          f"  refuses a secret file other users can read\n"
          f"  then start every server with --prfaas-zmq-curve-keys {os.path.abspath(d)}\n"
          f"  servers sharing a prfaas_hybrid storage tier: {KEY_FILE}, with --prfaas-tier-key "
          f"{os.path.join(os.path.abspath(d), KEY_FILE)}")
    return 0
