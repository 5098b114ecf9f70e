"""Tier entries under a tier key (HMAC-SHA256 over header and payload): an entry whose MAC does not
verify (flipped, signed under another key, unsigned) is refused, counted, dropped from its tier and
never returned; the key file is made and checked like the CURVE secrets; and a storage tier that others
can write is left out when no key is given."""
from __future__ import annotations

import os
import stat

import pytest

from prfaas_sgl.cachepool.tiers import KV, STATE, Fingerprint, HostTier, TierStack, Unauthenticated, decode, encode
from prfaas_sgl.cachepool.tiers.auth import KEY_FILE, load_key, shared_without_key, write_key
from prfaas_sgl.cachepool.tiers.entry import HEADER_BYTES

FP = Fingerprint("tiny|auth-test")
PAYLOAD = bytes(range(256)) * 4
KEY_A, KEY_B = b"a" * 64, b"b" * 64


def test_a_signed_entry_verifies_only_under_its_key():
    blob = encode(FP, KV, 5, PAYLOAD, KEY_A)
    assert decode(FP, KV, 5, blob, len(PAYLOAD), KEY_A) == PAYLOAD
    with pytest.raises(Unauthenticated, match="another tier key"):
        decode(FP, KV, 5, blob, len(PAYLOAD), KEY_B)
    with pytest.raises(Unauthenticated, match="unsigned"):
        decode(FP, KV, 5, encode(FP, KV, 5, PAYLOAD), len(PAYLOAD), KEY_A)
    # a forger who rewrites the payload and fixes the CRC (a public function) still fails the MAC
    forged = bytearray(encode(FP, KV, 5, bytes(len(PAYLOAD)), KEY_A))
    forged[HEADER_BYTES:] = PAYLOAD[::-1]
    forged[24:28] = encode(FP, KV, 5, PAYLOAD[::-1])[24:28]
    with pytest.raises(Unauthenticated):
        decode(FP, KV, 5, bytes(forged), len(PAYLOAD), KEY_A)


def test_a_flipped_mac_is_refused_counted_and_dropped():
    stack = TierStack(FP, HostTier(1 << 20), None, key=KEY_A)
    stack.put(STATE, 7, PAYLOAD)
    key = FP.key(STATE, 7)
    bad = bytearray(stack.host.get(key))
    bad[HEADER_BYTES - 1] ^= 0x01  # the MAC's last byte
    stack.host.put(key, bytes(bad))
    assert stack.get(STATE, 7, len(PAYLOAD)) is None
    assert (stack.stats.refused_mac, stack.stats.corrupt, stack.stats.misses) == (1, 0, 1)
    assert key not in stack.host


@pytest.mark.parametrize("writer_key", [KEY_B, None], ids=["another_key", "unsigned"])
def test_an_entry_a_store_got_from_another_writer_is_refused_and_removed(tmp_path, writer_key):
    from prfaas_sgl.srt.cachepool_backend.tier_storage import HiCacheFileBackend

    store = HiCacheFileBackend(str(tmp_path / "l3"))
    TierStack(FP, None, store, key=writer_key).put(KV, 3, PAYLOAD)
    assert store.exists(FP.key(KV, 3))
    reader = TierStack(FP, None, store, key=KEY_A)
    assert reader.get(KV, 3, len(PAYLOAD)) is None
    assert reader.stats.refused_mac == 1 and not store.exists(FP.key(KV, 3))
    TierStack(FP, None, store, key=KEY_A).put(KV, 3, PAYLOAD)
    assert reader.get(KV, 3, len(PAYLOAD)) == PAYLOAD  # the same key's own entry loads


def test_prfaas_keys_writes_a_tier_key_the_server_accepts(tmp_path):
    from prfaas_sgl.cli import main

    assert main(["keys", str(tmp_path / "k")]) == 0
    path = tmp_path / "k" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(load_key(str(path))) == 64


def test_a_key_file_others_can_read_or_too_short_is_refused_at_flag_parsing(tmp_path):
    from prfaas_sgl.config import PrfaasConfig

    path = str(tmp_path / KEY_FILE)
    write_key(path)
    assert PrfaasConfig(tier_key=path).tier_key == path
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="--prfaas-tier-key: .*chmod 600"):
        PrfaasConfig(tier_key=path)
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        f.write("short\n")
    with pytest.raises(ValueError, match="fewer than 32"):
        PrfaasConfig(tier_key=path)
    with pytest.raises(ValueError, match="cannot read"):
        PrfaasConfig(tier_key=str(tmp_path / "absent"))


def test_which_storage_tiers_others_can_write(tmp_path):
    assert shared_without_key("mooncake", "", "127.0.0.1:50051", "P2PHANDSHAKE") is None
    assert "not a loopback" in shared_without_key("mooncake", "", "10.0.0.5:50051", "P2PHANDSHAKE")
    assert "metadata server" in shared_without_key("mooncake", "", "127.0.0.1:1", "http://10.0.0.5:8080/metadata")
    assert "not a loopback" in shared_without_key("mooncake", "", "store.example:50051", "P2PHANDSHAKE")
    d = tmp_path / "l3"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert shared_without_key("file", str(d), "", "") is None
    os.chmod(d, 0o1777)  # a sticky bit still lets others create a key we have not written yet
    assert "other users can write" in shared_without_key("file", str(d), "", "")


