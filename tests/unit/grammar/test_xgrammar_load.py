"""The processes of the server's own that load xgrammar (the compile workers' fork server, a
simulated rank) load it without PyTorch's distributed tensors, which transformers would import
with it (torch.fx, SymPy: about 40% of the import and 70 MiB of each such process), and leave
`torch.distributed.is_available` as they found it. In a fresh interpreter: the import is the
point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.lanes import require_grammar

require_grammar()
pytestmark = pytest.mark.grammar

_PROBE = """
import sys
import torch.distributed as distributed
before = distributed.is_available
from deepinfer_server.grammar._xgr import load_xgrammar
xgr = load_xgrammar()
assert xgr.GrammarCompiler is not None
assert distributed.is_available is before, "is_available was not restored"
assert "torch.distributed.tensor" not in sys.modules, "distributed tensors were imported"
"""


def test_xgrammar_loads_without_distributed_tensors_and_restores_is_available() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
