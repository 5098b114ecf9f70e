"""S_kv(l) from a model's config.json: the bytes one request of l uncached tokens hands to decode, as
router/kv_accounting.py derives them from the layers (the same numbers the router's link accounting uses),
instead of hand-set `kv_mib` / `phi_gbps` tables.

    S_kv(l) = state + kv_per_token x l + swa_per_token x min(l, W)

    bytes ^                     ___/  slope kv_per_token (full-attention / MLA layers only)
          |                ___/
          |            .-'        slope kv_per_token + swa_per_token while the window fills
          |        .-'
    state +----'--------------------> l
               0        W

A scenario names the file in `[model] config = "path"` (a config.json, or the model directory holding it,
relative to the scenario file), with an optional `kv_dtype` (the server's --kv-cache-dtype; default the
config's dtype). `prfaas plan/simulate --model-config PATH` sets the same from the command line.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..kv_accounting import DTYPE_BYTES, Dtypes, KVAccount, account
from .curves import Curve, ProfileError


def kv_curve(acct: KVAccount) -> Curve:
    """S_kv as a Curve: a line without SWA layers; with them a table whose last segment (past the window)
    extrapolates with the full-attention slope, so the curve is exact at every length."""
    if not acct.swa_window:
        return Curve(poly=(float(acct.state_bytes), float(acct.kv_bytes_per_token)), field="model.config")
    xs = (0, acct.swa_window, 2 * acct.swa_window)
    return Curve(tuple(map(float, xs)), tuple(float(acct.request_bytes(x)) for x in xs), field="model.config")


def read_account(model: dict, base_dir: Path) -> KVAccount:
    """The KVAccount of `[model] config` (+ optional `kv_dtype`); every failure names the field."""
    path = base_dir / str(model["config"])
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ProfileError(f"model.config: {str(path)!r} not found (a config.json or a model directory)")
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"model.config: {path} is not valid JSON: {e}") from e
    dtypes = None
    if "kv_dtype" in model:
        kv = DTYPE_BYTES.get(str(model["kv_dtype"]))
        if kv is None:
            raise ProfileError(f"model.kv_dtype: expected one of {sorted(DTYPE_BYTES)}, got {model['kv_dtype']!r}")
        dtypes = Dtypes(kv=kv)
    try:
        return account(conf, dtypes)
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise ProfileError(f"model.config: {path} lacks a field its attention family needs: {e!r}") from e


def account_doc(acct: KVAccount) -> dict:
    """The accounting a plan reports (bytes)."""
    return {"family": acct.family, "kv_bytes_per_token": acct.kv_bytes_per_token, "state_bytes": acct.state_bytes,
            "swa_bytes_per_token": acct.swa_bytes_per_token, "swa_window": acct.swa_window}


def add_model_args(parser) -> None:
    """`--model-config` / `--kv-dtype` of `prfaas plan` and `prfaas simulate` (declared once)."""
    parser.add_argument("--model-config", metavar="PATH",
                        help="a model's config.json (or its directory): S_kv from its layers replaces [model]")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES),
                        help="KV element type of a config-derived S_kv (default: the config's dtype)")
