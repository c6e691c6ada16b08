"""What every model family must do, written once: a family's test file subclasses
:class:`FamilyTests` (or :class:`CachedFamilyTests` when the family decodes with a state) and
fills in the hooks below; pytest collects the inherited ``test_*`` methods for it.

Hooks:
    model_classes: every model class of the family (base model and heads).
    auto_map: the family's Auto-class table (``AUTO_MAP`` of its configuration module).
    padding_side: where padding goes in a batch (``"left"`` for causal LMs).
    make_config(**overrides): the family's tiny config (from ``tests/conftest.py``).
    make_inputs(batch, n, seed): the keyword arguments of a forward without padding.
    prepare(model): adjusts a freshly built model (e.g. a non-zero bias); returns it.
    expected_shapes(cls, config, batch, n): ``{output field: shape}`` for ``cls``.
    cache_variants (CachedFamilyTests): ``{name: config overrides}`` the cache parity runs over.
    cache_model_class (CachedFamilyTests): the class that decodes (e.g. the causal LM).
    cache_class_name (CachedFamilyTests): the class name of the decoding state ``generate`` returns.
"""

from __future__ import annotations

import json

import torch
import transformers
from transformers import GenerationMixin

from tests.remote import run_without_package

N = 9  # sequence length of the tests: differs from every head's label count


class FamilyTests:
    model_classes: tuple = ()
    auto_map: dict = {}
    padding_side = "right"

    # ------------------------------------------------------------------ hooks

    def make_config(self, **overrides):
        raise NotImplementedError

    def make_inputs(self, batch: int, n: int, seed: int = 0) -> dict:
        raise NotImplementedError

    def prepare(self, model):
        """Called on every freshly built model (after the seeded init); returns it."""
        return model

    def expected_shapes(self, cls, config, batch: int, n: int) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def build(self, cls, seed: int = 0, **overrides):
        torch.manual_seed(seed)
        return self.prepare(cls(self.make_config(**overrides))).eval()

    @staticmethod
    def tensors(out) -> dict:
        """The tensor fields of a model output (``past_key_values`` and other objects left out)."""
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def padding_mask(self, lengths, n):
        mask = torch.zeros(len(lengths), n, dtype=torch.long)
        for i, length in enumerate(lengths):
            if self.padding_side == "left":
                mask[i, n - length :] = 1
            else:
                mask[i, :length] = 1
        return mask

    # ------------------------------------------------------------------ tests

    def test_every_auto_class_has_a_model_class_and_all_heads_give_their_shapes(self):
        names = {cls.__name__ for cls in self.model_classes}
        listed = {path.rsplit(".", 1)[1] for auto, path in self.auto_map.items() if auto != "AutoConfig"}
        assert listed == names, f"auto_map lists {sorted(listed)}, the tests cover {sorted(names)}"
        for cls in self.model_classes:
            model = self.build(cls)
            config = model.config
            with torch.no_grad():
                out = model(**self.make_inputs(2, N))
            got = {k: tuple(v.shape) for k, v in self.tensors(out).items()}
            want = self.expected_shapes(cls, config, 2, N)
            assert got == want, f"{cls.__name__}: {got} != {want}"

    def test_padded_batch_equals_unpadded_rows_and_padding_never_leaks(self):
        """Every head on a batch whose padded slots hold NaN embeddings: each row's real
        positions equal that row run alone, and are finite (a NaN that entered any sum over
        keys would turn them NaN). float32 throughout; the two runs differ only in summation
        order over at most N keys and two layers, a few ulp of O(1) values, so atol 1e-5."""
        lengths = [N, N - 4, 2]
        mask = self.padding_mask(lengths, N)
        ids = self.make_inputs(len(lengths), N, seed=1)["input_ids"]
        for cls in self.model_classes:
            model = self.build(cls)
            embeds = model.get_input_embeddings()(ids).detach()
            embeds[mask == 0] = float("nan")
            with torch.no_grad():
                batch = self.tensors(model(inputs_embeds=embeds, attention_mask=mask))
                for i in range(len(lengths)):
                    real = mask[i].bool()
                    alone = self.tensors(model(inputs_embeds=embeds[i : i + 1, real]))
                    for name, value in alone.items():
                        row = batch[name][i : i + 1]
                        if row.dim() >= 2 and row.shape[1] == N:  # per-token field: real positions only
                            row = row[:, real]
                        assert torch.isfinite(row).all(), f"{cls.__name__}.{name} row {i}: padding leaked"
                        torch.testing.assert_close(row, value, rtol=0, atol=1e-5, msg=f"{cls.__name__}.{name} row {i}")

    def test_save_load_round_trip_through_safetensors_and_auto_classes(self, tmp_path):
        """Exact: the loaded model holds the same tensors and runs the same operations."""
        inputs = self.make_inputs(2, N, seed=2)
        autos = {path.rsplit(".", 1)[1]: auto for auto, path in self.auto_map.items()}
        for cls in self.model_classes:
            model = self.build(cls)
            path = tmp_path / cls.__name__
            model.save_pretrained(path)
            files = sorted(p.name for p in path.iterdir())
            assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files), files
            with torch.no_grad():
                want = self.tensors(model(**inputs))
            for loader in (cls, getattr(transformers, autos[cls.__name__])):
                loaded = loader.from_pretrained(path).eval()
                assert type(loaded) is cls
                with torch.no_grad():
                    got = self.tensors(loaded(**inputs))
                assert got.keys() == want.keys()
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)

    def remote_generate_check(self) -> bool:
        return False

    def test_remote_code_load_in_a_process_without_the_package(self, tmp_path):
        """Every head, saved Hub-ready, loads through its Auto class with ``trust_remote_code`` in
        one fresh process that cannot import hf_kernattn, and gives the same outputs (exact: the
        copied modules run the same operations on the same tensors; the subprocess inherits
        the thread settings). Causal LMs also generate the same tokens with the family's state."""
        inputs = self.make_inputs(2, N, seed=3)
        autos = {path.rsplit(".", 1)[1]: auto for auto, path in self.auto_map.items()}
        want, jobs = {}, []
        for cls in self.model_classes:
            model = self.build(cls)
            model.save_pretrained(tmp_path / cls.__name__)
            with torch.no_grad():
                want[cls.__name__] = {k: v.tolist() for k, v in self.tensors(model(**inputs)).items()}
            generate = self.remote_generate_check() and isinstance(model, GenerationMixin)
            if generate:
                want[cls.__name__ + ".generate"] = model.generate(
                    inputs["input_ids"], max_new_tokens=6, do_sample=False).tolist()
            jobs.append((cls.__name__, autos[cls.__name__], generate))
        (tmp_path / "inputs.json").write_text(json.dumps({k: v.tolist() for k, v in inputs.items()}))
        code = f"""
import json, torch, transformers
inputs = {{k: torch.tensor(v) for k, v in json.load(open("inputs.json")).items()}}
result = {{}}
for name, auto, generate in {jobs!r}:
    m = getattr(transformers, auto).from_pretrained(name, trust_remote_code=True).eval()
    assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
    assert type(m).__name__ == name, type(m).__name__
    with torch.no_grad():
        out = m(**inputs)
    result[name] = {{k: v.tolist() for k, v in out.items() if isinstance(v, torch.Tensor)}}
    if generate:
        g = m.generate(inputs["input_ids"], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        result[name + ".generate"] = g.sequences.tolist()
        result[name + ".cache"] = type(g.past_key_values).__name__
print(json.dumps(result))
"""
        got = json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1])
        for name, value in want.items():
            assert got[name] == value, f"{name} differs after remote-code loading"
        for name, _, generate in jobs:
            if generate:
                assert got[name + ".cache"] == self.cache_class_name


class CachedFamilyTests(FamilyTests):
    cache_variants: dict = {"default": {}}
    cache_model_class = None
    cache_class_name = ""

    def remote_generate_check(self) -> bool:
        return True

    def test_decoding_with_the_state_equals_recompute_on_a_padded_batch(self):
        """Prefill, a multi-token chunk on top of the state, then one token at a time, on a
        padded batch, equals one forward over everything without a state. float64, so the only
        difference is rounding of the two summation orders (1e-10 on O(1) logits)."""
        lengths, n = [13, 8], 13
        mask = self.padding_mask(lengths, n)
        ids = self.make_inputs(2, n, seed=4)["input_ids"]
        for variant, overrides in self.cache_variants.items():
            model = self.build(self.cache_model_class, **overrides).double()
            with torch.no_grad():
                full = model(ids, attention_mask=mask, use_cache=False).logits
                out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
                state = out.past_key_values
                pieces = [out.logits]
                out = model(ids[:, 6:10], attention_mask=mask[:, :10], past_key_values=state, use_cache=True)
                pieces.append(out.logits)
                for t in range(10, n):
                    out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=state, use_cache=True)
                    pieces.append(out.logits)
            steps = torch.cat(pieces, dim=1)
            real = mask.bool()
            torch.testing.assert_close(steps[real], full[real], rtol=0, atol=1e-10, msg=variant)
