"""Which KV manager SGLang gets: `conn.kv_manager` builds the role's subclass (prefill.py / decode.py) of the
shared base `manager.PrfaasKVManager`, which never imports its roles (test_structure_boundary checks the
package has no import circle, lazy imports included); the base alone serves neither role and is refused."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType  # noqa: E402

from prfaas_sgl.srt.backend.conn import kv_manager  # noqa: E402
from prfaas_sgl.srt.backend.decode import DecodeManager  # noqa: E402
from prfaas_sgl.srt.backend.manager import PrfaasKVManager  # noqa: E402
from prfaas_sgl.srt.backend.prefill import PrefillManager  # noqa: E402
from prfaas_sgl.srt.backend.sglang_backend import BACKEND, _around_get_kv_class  # noqa: E402

from .backend_fake_pd import make_pd  # noqa: E402,F401 - a fixture


def sglangs(class_type: KVClassType):
    return _around_get_kv_class(lambda *a: pytest.fail("SGLang's own class asked for"), BACKEND, class_type)


def test_sglang_asks_for_the_manager_and_gets_the_roles_builder():
    assert sglangs(KVClassType.MANAGER) is kv_manager


def test_each_role_gets_its_manager(make_pd):
    pd = make_pd()
    assert type(pd.p) is PrefillManager and type(pd.d) is DecodeManager


def test_the_shared_base_alone_is_refused():
    with pytest.raises(TypeError, match="shared base: build a manager with conn.kv_manager"):
        PrfaasKVManager(None, DisaggregationMode.PREFILL, None)


def test_a_mode_without_a_manager_is_refused():
    with pytest.raises(ValueError, match="prfaas_zmq: unsupported disaggregation mode"):
        kv_manager(None, DisaggregationMode.NULL, None)
