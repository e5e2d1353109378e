"""benchmarks.engine's CUDA-graph mode (moved here from benchmarks.kernels): on a host without CUDA it
says why it cannot run and exits 2, before loading any model."""

from __future__ import annotations

import pytest
import torch

from benchmarks import engine as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA this runs the real measurement")
def test_cuda_graphs_mode_needs_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--cuda-graphs", "--model", str(tmp_path / "not-loaded")])
    assert exit_.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().out
