"""The sliding-window hybrid (``softmax_window``) exports with a dynamic batch and length: the
traced program (a symbolic length runs the window form as one block, with no Python loop over
the tokens) gives the eager outputs at sizes other than the traced one, through ``torch.export``
and through ONNX in onnxruntime.

Tolerance: the exported graph computes the same weights as the eager chunked form, blocked
differently (one block instead of chunks of 64), so float32 sums of at most a few hundred O(1)
terms per layer are reassociated: well under 1e-5 on O(1) outputs; a program that baked in the
traced length would be off by O(1) or refuse to run.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from hf_kernattn import LinearGPTModel
from tests.conftest import V_GPT, tiny_linear_gpt_config

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = ({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)},) * 2


class _Hidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, attention_mask=mask, use_cache=False, return_dict=False)[0]


def _text(b: int, n: int, seed: int):
    ids = torch.randint(1, V_GPT, (b, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the first row
    return ids, mask


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    model = _Hidden(LinearGPTModel(tiny_linear_gpt_config(num_hidden_layers=1, softmax_window=3)).eval())
    with torch.no_grad():
        for p in (model.model.h[0].attn.window_log_weight, model.model.h[0].attn.linear_log_weight):
            p.uniform_(-0.5, 0.5)
        program = torch.export.export(model, _text(2, 10, 0), dynamic_shapes=SHAPES)
    return model, program


OTHERS = [_text(3, 17, 1), _text(1, 40, 2), _text(2, 10, 0)]


def test_torch_export_of_the_hybrid_runs_at_other_lengths(hybrid):
    model, program = hybrid
    with torch.no_grad():
        for inputs in OTHERS:
            torch.testing.assert_close(program.module()(*inputs), model(*inputs), **TOL)


def test_onnx_export_of_the_hybrid_runs_at_other_lengths(hybrid, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, program = hybrid
    with torch.no_grad():
        onnx_program = torch.onnx.export(program, _text(2, 10, 0), dynamo=True, dynamic_shapes=SHAPES)
    onnx_program.save(str(tmp_path / "hybrid.onnx"))
    session = ort.InferenceSession(str(tmp_path / "hybrid.onnx"), providers=["CPUExecutionProvider"])
    names = [x.name for x in session.get_inputs()]
    with torch.no_grad():
        for ids, mask in OTHERS:
            (got,) = session.run(None, {names[0]: ids.numpy(), names[1]: mask.numpy()})
            torch.testing.assert_close(torch.from_numpy(got), model(ids, mask), **TOL)
