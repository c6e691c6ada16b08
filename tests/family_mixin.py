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
    conformance_overrides: config overrides of the conformance checks (random-feature buffers,
        output flags): the family's configuration with random features.
    export_variants: ``{name: config overrides}`` the ``torch.export`` check runs over.
    export_class: the class that is exported (default the base model).
    layer_norm_field / config_fields_absent: the name of the family's layer-norm epsilon; shared
        fields the family's config does not have.
    tied_lm_class: the language-model head whose output embeddings are tied to the input ones
        (``None``: the family has no token embeddings).
    training_class / recompute_overrides / training_inputs(seed): the class trained in the
        checkpointing check, its config overrides, and one batch with labels.
    empty_inputs(): ``[(inputs, message)]``: empty inputs and the ValueError each must raise.
    forward_kwargs: extra keyword arguments of a plain forward (``use_cache=False`` for a family
        that decodes with a state).
    cache_variants (CachedFamilyTests): ``{name: config overrides}`` the cache parity runs over.
    cache_model_class (CachedFamilyTests): the class that decodes (e.g. the causal LM).
    cache_class_name (CachedFamilyTests): the class name of the decoding state ``generate`` returns.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GenerationMixin
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_kernattn.modeling.feature_maps import FeatureMap

from tests.conftest import checkpointing_enable
from tests.reference import assert_model_outputs_reordered_close
from tests.remote import run_without_package

N = 9  # sequence length of the tests: differs from every head's label count


class FamilyTests:
    model_classes: tuple = ()
    auto_map: dict = {}
    padding_side = "right"
    conformance_overrides: dict = {}
    forward_kwargs: dict = {}
    export_variants: dict = {"default": {}}
    export_class = None
    layer_norm_field = "layer_norm_eps"
    config_fields_absent: tuple = ()
    tied_lm_class = None
    training_class = None
    recompute_overrides: dict = {}

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

    @staticmethod
    def feature_maps(model) -> list:
        return [m for m in model.modules() if isinstance(m, FeatureMap)]

    def base_class(self):
        """The base model class (the first of ``model_classes``)."""
        return self.model_classes[0]

    def base_config(self, **overrides):
        """The family's config with ``conformance_overrides`` (random features) and ``overrides``."""
        return self.make_config(**{**self.conformance_overrides, **overrides})

    def hidden(self, model, inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, **self.forward_kwargs).last_hidden_state

    @staticmethod
    def assert_reordered(got, want, config, n: int, msg=None) -> None:
        assert_model_outputs_reordered_close(got, want, config, n, msg=msg)

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
        order (another batch shape): within the float32 bound of reordered sums."""
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
                        self.assert_reordered(row, value, model.config, N, msg=f"{cls.__name__}.{name} row {i}")

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

    # random-feature buffers: checkpoints without them, partial ones, mismatched sizes, meta device

    def test_checkpoint_without_feature_buffers_loads_seeded_projections_and_warns(self, tmp_path):
        cls = self.base_class()
        torch.manual_seed(0)
        model = cls(self.base_config()).eval()
        model.save_pretrained(tmp_path)
        path = os.path.join(tmp_path, "model.safetensors")
        state = load_file(path)
        dropped = [k for k in state if ".feature_map." in k]
        assert dropped
        save_file({k: v for k, v in state.items() if k not in dropped}, path, metadata={"format": "pt"})

        logger = logging.get_logger("hf_kernattn.modeling.pretrained")
        with CaptureLogger(logger) as captured:
            loaded = cls.from_pretrained(tmp_path).eval()
        assert "no random-feature buffers" in captured.out and "feature_seed=0" in captured.out
        for fresh, got in zip(self.feature_maps(model), self.feature_maps(loaded)):
            assert torch.equal(got.projection, fresh.projection)  # draw 0 of the seed, as built
            assert int(got.num_draws) == 0 and int(got.num_steps) == 0
        inputs = self.make_inputs(2, N)
        torch.testing.assert_close(self.hidden(loaded, inputs), self.hidden(model, inputs), rtol=0, atol=0)

        # a complete checkpoint loads without the warning
        model.save_pretrained(tmp_path)
        with CaptureLogger(logger) as captured:
            cls.from_pretrained(tmp_path)
        assert "random-feature" not in captured.out

    def test_loaded_feature_buffers_are_kept_when_others_are_missing(self, tmp_path):
        cls = self.base_class()
        torch.manual_seed(0)
        model = cls(self.base_config()).eval()
        fresh = [f.projection.clone() for f in self.feature_maps(model)]
        for fmap in self.feature_maps(model):
            fmap.redraw()  # a projection no fresh model has
        model.save_pretrained(tmp_path)
        path = os.path.join(tmp_path, "model.safetensors")
        state = load_file(path)
        save_file({k: v for k, v in state.items() if not k.endswith("num_steps")}, path, metadata={"format": "pt"})
        loaded = cls.from_pretrained(tmp_path)
        got_maps = self.feature_maps(loaded)
        assert got_maps and len(got_maps) == len(fresh)
        for want, got, first in zip(self.feature_maps(model), got_maps, fresh):
            assert torch.equal(got.projection, want.projection) and not torch.equal(got.projection, first)
            assert int(got.num_draws) == 1 and int(got.num_steps) == 0

    def test_mismatched_num_random_features_draws_from_the_seed(self, tmp_path):
        cls = self.base_class()
        torch.manual_seed(0)
        cls(self.base_config()).save_pretrained(tmp_path)
        loaded, info = cls.from_pretrained(
            tmp_path, num_random_features=32, ignore_mismatched_sizes=True, output_loading_info=True
        )
        assert any(k.endswith("projection") for k, *_ in info["mismatched_keys"])
        fresh = cls(self.base_config(num_random_features=32))
        for want, got in zip(self.feature_maps(fresh), self.feature_maps(loaded)):
            assert got.projection.shape == (32, got.head_dim)
            assert torch.equal(got.projection, want.projection)
        assert torch.isfinite(self.hidden(loaded.eval(), self.make_inputs(2, N))).all()

    def test_meta_device_build_then_init_weights_sets_every_buffer(self):
        cls = self.base_class()
        reference = cls(self.base_config())
        with torch.device("meta"):
            model = cls(self.base_config())
        model.to_empty(device="cpu")
        with torch.no_grad():  # what uninitialised memory may hold
            for t in list(model.parameters()) + list(model.buffers()):
                t.fill_(float("nan") if t.is_floating_point() else 7)
        model.init_weights()
        for want, got in zip(self.feature_maps(reference), self.feature_maps(model)):
            assert torch.equal(got.projection, want.projection)
            assert int(got.num_draws) == 0 and int(got.num_steps) == 0
        bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not torch.isfinite(t.float()).all()]
        assert not bad, bad
        assert torch.isfinite(self.hidden(model.eval(), self.make_inputs(2, N))).all()

    # output flags

    def test_output_attentions_is_refused_the_same_way_in_every_family(self):
        cls = self.base_class()
        model = cls(self.base_config())
        inputs = self.make_inputs(2, N)
        with pytest.raises(ValueError, match="no attention weights"):
            model(**inputs, output_attentions=True)
        # the config keeps the flag (tests/models/test_config_contract.py); forward returns no attentions
        assert self.base_config(output_attentions=True).output_attentions is True
        model.config.output_attentions = True
        assert getattr(model(**inputs), "attentions", None) is None
        with pytest.raises(ValueError, match="no attention weights"):
            model(**inputs, output_attentions=True)
        assert not cls._supports_attention_backend

    def test_hidden_states_and_return_dict_false_tuples(self):
        cls = self.base_class()
        torch.manual_seed(0)
        model = cls(self.base_config()).eval()
        inputs = self.make_inputs(2, N)
        extra = self.forward_kwargs
        with torch.no_grad():
            as_dict = model(**inputs, output_hidden_states=True, **extra)
            as_tuple = model(**inputs, output_hidden_states=True, return_dict=False, **extra)
        assert len(as_dict.hidden_states) == model.config.num_hidden_layers + 1
        assert isinstance(as_tuple, tuple)
        want = [v for v in as_dict.to_tuple()]
        assert len(as_tuple) == len(want)
        for got, ref in zip(as_tuple, want):
            if isinstance(ref, tuple):
                assert all(torch.equal(a, b) for a, b in zip(got, ref))
            else:
                assert torch.equal(got, ref)
        if "input_ids" in inputs:  # inputs_embeds give the same outputs as input_ids
            with torch.no_grad():
                embeds = model.get_input_embeddings()(inputs["input_ids"])
                torch.testing.assert_close(model(inputs_embeds=embeds, **extra).last_hidden_state, as_dict.last_hidden_state)

    def test_output_hidden_states_selects_layers_as_transformers_does(self):
        """``output_hidden_states`` as an int or a list of ints (transformers 5.24's selection, negative
        indices from the end): those hidden states, None in the other places, the selected ones equal to
        those of ``True``; a bad value is a TypeError naming the argument."""
        cls = self.base_class()
        torch.manual_seed(0)
        model = cls(self.base_config()).eval()
        inputs = self.make_inputs(2, N)
        extra = self.forward_kwargs
        count = model.config.num_hidden_layers + 1
        with torch.no_grad():
            every = model(**inputs, output_hidden_states=True, **extra).hidden_states
            for request, want in (([0, 2], {0, 2}), (-1, {count - 1}), (1, {1}), ([count + 3], set()),
                                  ((0, -1), {0, count - 1})):
                got = model(**inputs, output_hidden_states=request, **extra).hidden_states
                assert len(got) == count, request
                assert {i for i, h in enumerate(got) if h is not None} == want, request
                assert all(torch.equal(got[i], every[i]) for i in want), request
            with pytest.raises(TypeError, match="output_hidden_states must be a bool, an int or a list of ints"):
                model(**inputs, output_hidden_states="all", **extra)

    def training_inputs(self, seed: int) -> dict:
        """Token families: a language-model batch (the ids are their own labels)."""
        ids = self.make_inputs(2, N, seed=seed)["input_ids"]
        return {"input_ids": ids, "labels": ids}

    def empty_inputs(self) -> list:
        """Token families: no rows, or rows of no tokens, as ids and as embeddings."""
        width = self.make_config().hidden_size
        return [
            (inputs, "batch")
            for shape in ((0, 5), (2, 0))
            for inputs in ({"input_ids": torch.zeros(shape, dtype=torch.long)},
                           {"inputs_embeds": torch.zeros(*shape, width)})
        ]

    # bad inputs and configs

    def test_empty_inputs_raise_a_clear_error(self):
        model = self.base_class()(self.base_config())
        for inputs, message in self.empty_inputs():
            with pytest.raises(ValueError, match=message):
                model(**inputs)

    @pytest.mark.parametrize(
        "field,value,error",
        [
            ("attention_eps", float("nan"), ValueError),
            ("attention_eps", -1e-6, ValueError),
            ("initializer_range", -0.02, ValueError),
            ("initializer_range", float("inf"), ValueError),
            ("hidden_act", "no_such_activation", ValueError),
            ("feature_seed", 1.5, TypeError),
            ("feature_seed", -1, ValueError),
            ("use_cache", "yes", TypeError),
            ("LAYER_NORM", -1e-5, ValueError),
            ("LAYER_NORM", float("nan"), ValueError),
        ],
    )
    def test_configs_refuse_bad_shared_fields(self, field, value, error):
        if field in self.config_fields_absent:
            pytest.skip(f"the family's config has no {field}")
        if field == "LAYER_NORM":
            field = self.layer_norm_field
        with pytest.raises(error, match=field):
            self.make_config(**{field: value})

    # token embeddings

    def test_resize_token_embeddings_keeps_the_tie(self):
        if self.tied_lm_class is None:
            pytest.skip("the family has no token embeddings")
        torch.manual_seed(0)
        model = self.tied_lm_class(self.make_config(**{k: v for k, v in self.conformance_overrides.items()
                                                       if k not in ("feature_map", "num_random_features")}))
        vocab = model.config.vocab_size
        model.resize_token_embeddings(vocab + 6)
        assert model.config.vocab_size == vocab + 6
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        ids = self.make_inputs(2, N)["input_ids"]
        ids[0, 0] = vocab + 5  # a new id
        out = model(ids)
        assert out.logits.shape[-1] == vocab + 6 and torch.isfinite(out.logits).all()

    # gradient checkpointing

    def test_checkpointed_layers_recompute_with_the_features_of_their_forward(self):
        """Gradient accumulation with feature redraws: two training forwards (each redraws) before
        one backward. A checkpointed layer recomputes in the backward, after the second redraw; it
        must use the projection its own forward used. Reference: the same model without any
        recomputation (float64; identical operations, so ulp-level agreement)."""
        batches = []
        for seed in (1, 2):
            batch = self.training_inputs(seed)
            batches.append({k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
        grads = []
        for checkpointing in (False, True):
            torch.manual_seed(0)
            config = self.base_config(feature_redraw_interval=1, **self.recompute_overrides)
            model = self.training_class(config).double().train()
            if checkpointing:
                checkpointing_enable(model)
            loss = sum(model(**batch, **self.forward_kwargs).loss for batch in batches)
            loss.backward()
            assert all(int(f.num_draws) == 2 for f in self.feature_maps(model))
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, rtol=1e-12, atol=1e-14, msg=name)

    def test_recompute_projections_gives_the_same_loss_and_gradients_with_dropout(self):
        """``recompute_attention="projections"`` (the whole attention block run again in the
        backward pass, its dropout masks restored from the saved random state) against keeping
        everything: the same loss and gradients (float64, the same operations: ulps at most)."""
        batch = {k: v.double() if v.is_floating_point() else v for k, v in self.training_inputs(1).items()}
        results = []
        for recompute in (False, "projections"):
            torch.manual_seed(0)
            config = self.base_config(recompute_attention=recompute, **{
                k: v for k, v in self.recompute_overrides.items() if k != "recompute_attention"})
            for name in ("attention_probs_dropout_prob", "attn_pdrop", "hidden_dropout_prob", "resid_pdrop"):
                if hasattr(config, name):
                    setattr(config, name, 0.1)
            model = self.training_class(config).double().train()
            torch.manual_seed(1)
            loss = model(**batch, **self.forward_kwargs).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (loss_a, grads_a), (loss_b, grads_b) = results
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-14)
        assert grads_a.keys() == grads_b.keys()
        for name, g in grads_a.items():
            torch.testing.assert_close(grads_b[name], g, rtol=1e-12, atol=1e-14, msg=name)

    # torch.export

    def test_torch_export_matches_eager(self):
        """Every variant exports with torch.export (no data-dependent Python reads while tracing)
        and the exported program gives eager's first output (the same operations, but the
        exported graph may sum in another order, e.g. decomposed ops on another machine's
        kernels: within the float32 bound of reordered sums, never bitwise)."""
        cls = self.export_class or self.base_class()
        for variant, overrides in self.export_variants.items():
            torch.manual_seed(0)
            model = cls(self.base_config(**overrides)).eval()
            (name, value), = self.make_inputs(2, 10).items()
            extra = dict(return_dict=False) | self.forward_kwargs
            with torch.no_grad():
                program = torch.export.export(model, (value,), kwargs=extra)
                got = program.module()(value, **extra)[0]
                want = model(value, **extra)[0]
            self.assert_reordered(got, want, model.config, 10, msg=variant)

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
    forward_kwargs = {"use_cache": False}
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
