"""Export with dynamic shapes: ``torch.export`` of every family with a dynamic batch and
sequence length (NPRF-BERT, Linear GPT's base model) or a dynamic batch and patch grid (the
relative-performer ViT: image height and width as multiples of the patch size), run at sizes
other than the traced ones; then the same programs through ``torch.onnx.export(dynamo=True)``
and onnxruntime (optional packages: ``pip install 'hf-kernattn[onnx]'``).

Tolerance: the programs run the same operations as eager mode, but the exported graph may
reorder float32 sums (decomposed ops, other kernels on other machines): within
``tests.reference.reorder_atol``, a float32 bound scaled by the compared values' magnitude (the
longest sum: the widest projection or the sequence; four chained reductions per layer); a
program that baked in a traced size would be off by O(1) or fail to run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

from hf_kernattn import LinearGPTModel, NPRFBertModel, RelativePerformerViTForImageClassification

from tests.conftest import V_BERT, V_GPT
from tests.conftest import tiny_linear_gpt_config as gpt_config
from tests.conftest import tiny_nprf_bert_config as bert_config
from tests.conftest import tiny_relative_performer_vit_config as vit_config
from tests.reference import assert_model_outputs_reordered_close

BATCH = Dim("batch", min=1, max=256)
SEQ = Dim("seq", min=2, max=64)  # max_position_embeddings of the tiny configs (absolute positions)
GRID_H, GRID_W = Dim("grid_h", min=2, max=64), Dim("grid_w", min=2, max=64)
LONG = Dim("long", min=2, max=4096)  # without absolute positions: beyond auto's dense and windowed thresholds


def _text(vocab: int, b: int, n: int, seed: int, left: bool):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, n), generator=gen)
    mask = torch.ones_like(ids)
    if left:
        mask[0, :3] = 0
    else:
        mask[-1, n - 4:] = 0
    return ids, mask


def _image(b: int, gh: int, gw: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(b, 1, 4 * gh, 4 * gw, generator=gen)
    mask = torch.ones(b, gh, gw, dtype=torch.long)
    mask[-1, -1] = 0  # the last image's last grid row is padding
    return pixels, mask


class _Outputs(torch.nn.Module):
    """A model with its options bound and plain tensor inputs (what ONNX graphs take)."""

    def __init__(self, model: torch.nn.Module, family: str) -> None:
        super().__init__()
        self.model, self.family = model, family

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.family == "nprf_bert":
            return self.model(x, attention_mask=mask, return_dict=False)[0]
        if self.family == "linear_gpt":
            return self.model(x, attention_mask=mask, use_cache=False, return_dict=False)[0]
        return self.model(pixel_values=x, patch_mask=mask).logits


# family -> (model, traced inputs, dynamic shapes, inputs of other sizes)
CASES = {
    "nprf_bert": lambda: (
        NPRFBertModel(bert_config(num_hidden_layers=1)), _text(V_BERT, 2, 10, 0, False),
        ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}), [_text(V_BERT, 3, 17, 1, False), _text(V_BERT, 1, 40, 2, False)],
    ),
    "linear_gpt": lambda: (
        LinearGPTModel(gpt_config(num_hidden_layers=1)), _text(V_GPT, 2, 10, 0, True),
        ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}), [_text(V_GPT, 3, 17, 1, True), _text(V_GPT, 1, 40, 2, True)],
    ),
    # a declared range beyond the lengths where eager mode leaves dense (windowed at N >= 512 for
    # NPRF-BERT's bias clipped at 8, causal_chunked above 192 for Linear GPT): the program takes
    # one backend for all lengths and still equals eager mode at 600 tokens
    "nprf_bert_long": lambda: (
        NPRFBertModel(bert_config(num_hidden_layers=1, position_embedding_type="none")), _text(V_BERT, 2, 10, 0, False),
        ({0: BATCH, 1: LONG}, {0: BATCH, 1: LONG}), [_text(V_BERT, 1, 600, 1, False)],
    ),
    "linear_gpt_long": lambda: (
        LinearGPTModel(gpt_config(num_hidden_layers=1, position_embedding_type="none")), _text(V_GPT, 2, 10, 0, True),
        ({0: BATCH, 1: LONG}, {0: BATCH, 1: LONG}), [_text(V_GPT, 1, 600, 1, True)],
    ),
    "vit_learned_2d_cls": lambda: (
        RelativePerformerViTForImageClassification(vit_config(num_hidden_layers=1, pooling="cls")), _image(2, 4, 3, 0),
        ({0: BATCH, 2: 4 * GRID_H, 3: 4 * GRID_W}, {0: BATCH, 1: GRID_H, 2: GRID_W}),
        [_image(3, 5, 7, 1), _image(1, 2, 9, 2)],
    ),
    "vit_manhattan": lambda: (
        RelativePerformerViTForImageClassification(vit_config(num_hidden_layers=1, rpe="manhattan")), _image(2, 4, 3, 0),
        ({0: BATCH, 2: 4 * GRID_H, 3: 4 * GRID_W}, {0: BATCH, 1: GRID_H, 2: GRID_W}),
        [_image(3, 6, 5, 1), _image(1, 9, 2, 2)],
    ),
}
ONNX_CASES = ["nprf_bert", "linear_gpt", "vit_learned_2d_cls"]


def _close(got, want, model: _Outputs, x: torch.Tensor) -> None:
    """``got`` is ``want`` up to the order of float32 sums over the sequence (or grid)."""
    config = model.model.config
    n = x.shape[1] if model.family != "vit" else (x.shape[2] // config.patch_size) * (x.shape[3] // config.patch_size)
    assert_model_outputs_reordered_close(got, want, config, n)


@pytest.fixture(scope="module")
def exported():
    """Each case's model, exported program, traced inputs, dynamic shapes and other inputs
    (exported once for the module: an export takes seconds)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            torch.manual_seed(0)
            model, args, shapes, others = CASES[case]()
            family = "vit" if case.startswith("vit") else case.replace("_long", "")
            wrapped = _Outputs(model.eval(), family)
            with torch.no_grad():
                program = torch.export.export(wrapped, args, dynamic_shapes=shapes)
            cache[case] = (wrapped, program, args, shapes, others)
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_torch_export_with_dynamic_shapes_matches_eager_at_other_sizes(exported, case):
    """One program serves every batch size and length (grid): at the traced size and at two
    others (one of batch 1), with padding in the batch, it gives the eager outputs."""
    model, program, args, _, others = exported(case)
    with torch.no_grad():
        for inputs in [args] + others:
            got = program.module()(*inputs)
            want = model(*inputs)
            assert got.shape == want.shape
            _close(got, want, model, inputs[0])


@pytest.mark.parametrize("case", ONNX_CASES)
def test_onnx_export_with_dynamic_shapes_runs_in_onnxruntime(exported, case, tmp_path):
    """``torch.onnx.export(program, dynamo=True, dynamic_shapes=...)`` of each family gives a
    graph whose inputs have symbolic batch and length (grid) dimensions; onnxruntime runs it at
    sizes other than the traced one with the eager outputs."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, program, args, shapes, others = exported(case)
    path = tmp_path / "model.onnx"
    with torch.no_grad():
        onnx_program = torch.onnx.export(program, args, dynamo=True, dynamic_shapes=shapes)
    onnx_program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    assert len(inputs) == 2
    for given, dynamic in zip(inputs, shapes):  # the dynamic dimensions stay symbolic (named) in the graph
        assert all(isinstance(given.shape[axis], str) for axis in dynamic), (given.name, given.shape)
    with torch.no_grad():
        for x, mask in others:
            (got,) = session.run(None, {inputs[0].name: x.numpy(), inputs[1].name: mask.numpy()})
            _close(torch.from_numpy(got), model(x, mask), model, x)


@pytest.mark.parametrize("dynamic", [False, True])
def test_transformers_exporter_exports_the_prefill_and_decode_steps_of_generate(dynamic):
    """transformers' own exporter (``transformers.exporters``, 5.23 on) captures the prefill and
    decode calls of ``generate()`` with their recurrent state (the cache object and everything
    it holds, the state's kind included, walked and rebuilt) and exports each; the exported
    programs give the eager outputs (logits and the new state; each within the float32 bound of
    reordered sums at its own magnitude: the state sums over the hidden width and the tokens)."""
    exporters = pytest.importorskip("transformers.exporters")
    from transformers.exporters.utils import decompose_prefill_decode, get_leaf_tensors

    from hf_kernattn import LinearGPTForCausalLM

    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = torch.randint(1, V_GPT, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    components = decompose_prefill_decode(model, inputs, multi_token_decode=dynamic)
    exporter, config = exporters.DynamoExporter(), exporters.DynamoConfig(dynamic=dynamic)
    for name, (module, step_inputs) in components.items():
        with torch.no_grad():
            eager = get_leaf_tensors(module(**copy.deepcopy(step_inputs)))
            exported = exporter.export(module, step_inputs, config=config)
            # an ExportedModel (called like the model) or, in earlier releases, the ExportedProgram
            run = exported.module() if hasattr(exported, "module") else exported
            got = get_leaf_tensors(run(**copy.deepcopy(step_inputs)))
        assert set(got) == set(eager) and eager, (name, sorted(got), sorted(eager))
        for key in eager:
            assert_model_outputs_reordered_close(got[key], eager[key], model.config, ids.shape[1], msg=f"{name}: {key}")
