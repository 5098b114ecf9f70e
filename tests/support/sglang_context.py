"""SGLang's process-wide runtime context for in-process pool/allocator tests: SGLang's pool classes read
server args from it, so each test publishes a CPU ServerArgs and resets it after. Import the fixture into a
test module (it is autouse there)."""
from __future__ import annotations

import pytest
from sglang.srt import runtime_context as sglang_rc
from sglang.srt.server_args import ServerArgs


@pytest.fixture(autouse=True)
def sglang_context():
    sglang_rc.reset_context()
    sglang_rc.publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
    yield
    sglang_rc.reset_context()
