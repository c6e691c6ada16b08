"""``hf-kernattn eval``: a Linear GPT, a linearized GPT-2 (a sliding-window hybrid) and a stock
GPT-2 compared in one command; the numbers equal a plain float64 full forward binned by hand,
scoring in chunks with the carried cache equals one forward, the recall figures of a trial are
recomputed by hand, and the hybrids' window/linear shares equal a dense float64 computation.

Tolerances: every compared pair is computed in float64 from the same weights, the chunked and
the full forward differing only in summation order: about 1e-15 relative per operation over a
few hundred operations, so 1e-9 is far above rounding and far below any real difference."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from hf_kernattn.cli import main

V = 40  # word-level vocabulary: <unk>, <eos>, w2 .. w39
N_GPT2 = 32  # the stock GPT-2's positions: shorter than MAX_LENGTH, so its last bin is missing
MAX_LENGTH = 48
TOL = dict(rtol=1e-9, atol=1e-12)  # torch.testing.assert_close
APPROX = dict(rel=1e-9, abs=1e-12)  # pytest.approx: the same


def _tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, V)}}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Three local models sharing one word-level tokenizer, and a text of 400 words."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_kernattn import LinearGPTForCausalLM
    from hf_kernattn.convert.linearize import linearize
    from tests.conftest import tiny_linear_gpt_config

    root = tmp_path_factory.mktemp("eval")
    g = torch.Generator().manual_seed(1)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(2, V, (400,), generator=g)))
    torch.manual_seed(0)
    gpt2 = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=N_GPT2, bos_token_id=1,
                               eos_token_id=1, initializer_range=0.3)).save_pretrained(gpt2)
    _tokenizer(gpt2)
    linear = root / "linear"  # rope positions: no position table, scored to any length
    LinearGPTForCausalLM(tiny_linear_gpt_config(vocab_size=V, position_embedding_type="rope")).save_pretrained(linear)
    _tokenizer(linear)
    hybrid = root / "hybrid"  # GPT-2 linearized into a sliding-window hybrid (window 4, learned feature map)
    linearize(gpt2, hybrid, train_files=[str(text)], steps=2, batch_size=2, block_size=16, softmax_window=4,
              progress=False)
    return {"gpt2": gpt2, "linear": linear, "hybrid": hybrid, "text": text, "root": root}


def _hand_losses(folder, ids: torch.Tensor, limit) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss and top-1 hits of one plain float64 forward over ``ids[:, :limit]``:
    NaN (and False) where nothing is predicted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    n = ids.shape[1] if limit is None else min(limit, ids.shape[1])
    with torch.no_grad():
        logp = F.log_softmax(model(ids[:, :n], use_cache=False).logits.double(), dim=-1)
    loss = torch.full(ids.shape, math.nan, dtype=torch.float64)
    hit = torch.zeros(ids.shape, dtype=torch.bool)
    loss[:, 1:n] = -logp[:, :-1].gather(-1, ids[:, 1:n, None])[..., 0]
    hit[:, 1:n] = logp[:, :-1].argmax(-1) == ids[:, 1:n]
    return loss, hit


def _word_ids(setup) -> torch.Tensor:
    return torch.tensor([int(w[1:]) for w in setup["text"].read_text().split()])


def test_context_compares_three_models_in_one_command(setup, tmp_path, capsys):
    out = tmp_path / "context"
    names = ["gpt2", "linear", "hybrid"]
    rc = main(["-q", "eval", "context", *(str(setup[n]) for n in names), "--text", str(setup["text"]),
               "--max_length", str(MAX_LENGTH), "--max_windows", "3", "--chunk_size", "10", "--batch_size", "2",
               "--dtype", "float64", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "positions" in printed and "32-47" in printed and "hybrid: share of attention in the softmax window" in printed
    report = json.loads((out / "context.json").read_text())
    assert [m["name"] for m in report["models"]] == names
    assert report["settings"]["windows"] == 3 and report["settings"]["max_length"] == MAX_LENGTH
    edges = [1, 2, 4, 8, 16, 32, 48]
    assert [(b["lo"], b["hi"]) for b in report["bins"]] == list(zip(edges[:-1], edges[1:]))
    # by hand: three consecutive windows of the text, one float64 forward each model, binned
    windows = _word_ids(setup)[: 3 * MAX_LENGTH].view(3, MAX_LENGTH)
    limits = {"gpt2": N_GPT2, "linear": None, "hybrid": N_GPT2}
    rows = list(csv.DictReader(open(out / "context.csv")))
    assert set(rows[0]) == {"model", "bin_lo", "bin_hi", "mean_loss", "count"} and len(rows) == 3 * 6
    for m in report["models"]:
        assert m["max_positions"] == limits[m["name"]]
        loss, _ = _hand_losses(setup[m["name"]], windows, limits[m["name"]])
        for b in m["bins"]:
            part = loss[:, b["lo"]:b["hi"]]
            part = part[torch.isfinite(part)]
            assert b["count"] == part.numel()
            if part.numel() == 0:  # beyond the model's positions: missing, not zero
                assert b["mean_loss"] is None
            else:
                assert b["mean_loss"] == pytest.approx(float(part.mean()), **APPROX)
        scored = loss[torch.isfinite(loss)]
        assert m["mean_loss"] == pytest.approx(float(scored.mean()), **APPROX)
    gpt2 = report["models"][0]
    assert gpt2["bins"][-1] == {"lo": 32, "hi": 48, "mean_loss": None, "count": 0}
    assert [r["mean_loss"] for r in rows if r["model"] == "gpt2"][-1] == ""
    # the hybrid's shares come with the same pass, in the JSON and in hybrid.csv
    assert gpt2["hybrid"] is None and report["models"][1]["hybrid"] is None
    layers = report["models"][2]["hybrid"]
    assert [layer["layer"] for layer in layers] == [0, 1] and all(layer["window"] == 4 for layer in layers)
    for layer in layers:
        assert layer["queries"] == 3 * (N_GPT2 - 4) and len(layer["heads"]) == 2
        assert layer["window_share"] + layer["linear_share"] == pytest.approx(1.0, abs=1e-12)
        assert 0 < layer["window_share"] < 1
    hybrid_rows = list(csv.DictReader(open(out / "hybrid.csv")))
    assert len(hybrid_rows) == 4 and {r["model"] for r in hybrid_rows} == {"hybrid"}
    assert (out / "context.png").stat().st_size > 1000


def test_recall_compares_three_models_and_one_trial_recomputes_by_hand(setup, tmp_path, capsys):
    from transformers import AutoTokenizer

    from hf_kernattn.evaluation import recall_trials

    out = tmp_path / "recall"
    names = ["gpt2", "linear", "hybrid"]
    distances = [0, 6, 40]
    rc = main(["-q", "eval", "recall", *(str(setup[n]) for n in names), "--text", str(setup["text"]),
               "--distances", *map(str, distances), "--span_length", "5", "--trials", "1", "--seed", "3",
               "--chunk_size", "7", "--dtype", "float64", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    assert "top-1 accuracy on the repeated span" in capsys.readouterr().out
    report = json.loads((out / "recall.json").read_text())
    rows = list(csv.DictReader(open(out / "recall.csv")))
    assert set(rows[0]) == {"model", "distance", "first_loss", "first_accuracy", "repeat_loss", "repeat_accuracy",
                            "tokens"}
    assert len(rows) == 3 * len(distances)
    assert (out / "recall.png").stat().st_size > 1000
    # the one trial: the span is 5 distinct ordinary ids, the filler a stretch of the text
    tok = AutoTokenizer.from_pretrained(setup["gpt2"])
    text = setup["text"].read_text()
    spans, stream, starts = recall_trials(tok, [text], distances, span_length=5, trials=1, seed=3)
    span = spans[0]
    assert len(set(span.tolist())) == 5 and int(span.min()) >= 2 and int(span.max()) < V  # not <unk>, <eos>
    assert torch.equal(stream, _word_ids(setup)) and 0 <= int(starts[0]) <= len(stream) - max(distances)
    for m in report["models"]:
        limit = N_GPT2 if m["name"] != "linear" else None
        for row in m["distances"]:
            d = row["distance"]
            assert row["tokens"] == 4
            if limit is not None and 10 + d > limit:
                assert row["repeat_loss"] is None and row["first_accuracy"] is None
                continue
            seq = torch.cat([span, stream[int(starts[0]):int(starts[0]) + d], span])[None]
            loss, hit = _hand_losses(setup[m["name"]], seq, None)
            first, repeat = slice(1, 5), slice(5 + d + 1, 10 + d)
            assert row["first_loss"] == pytest.approx(float(loss[0, first].mean()), **APPROX)
            assert row["repeat_loss"] == pytest.approx(float(loss[0, repeat].mean()), **APPROX)
            assert row["first_accuracy"] == float(hit[0, first].double().mean())
            assert row["repeat_accuracy"] == float(hit[0, repeat].double().mean())
    # the same seed draws the same trial; another seed another one
    again = recall_trials(tok, [text], distances, span_length=5, trials=1, seed=3)
    assert torch.equal(again[0], spans) and torch.equal(again[2], starts)
    other = recall_trials(tok, [text], distances, span_length=5, trials=4, seed=4)
    assert not torch.equal(other[0][:1], spans) or not torch.equal(other[2][:1], starts)


def test_chunked_scoring_with_the_carried_state_equals_one_forward(setup):
    """Linear GPT (rope) at 3x its chunk and beyond any position table, GPT-2 with its KV cache:
    every chunking gives the full float64 forward's losses and hits."""
    from transformers import AutoModelForCausalLM

    from hf_kernattn.evaluation import chunk_bounds, score_tokens

    ids = _word_ids(setup)[:2 * 30].view(2, 30)
    for name in ("linear", "gpt2"):
        model = AutoModelForCausalLM.from_pretrained(setup[name], dtype=torch.float64).eval()
        full_loss, full_hit = _hand_losses(setup[name], ids, None)
        for chunk in (2, 7, 29, 30):
            loss, hit = score_tokens(model, ids, chunk_size=chunk)
            assert torch.isnan(loss[:, 0]).all()
            torch.testing.assert_close(loss[:, 1:], full_loss[:, 1:], **TOL)
            assert torch.equal(hit, full_hit)
        loss, _ = score_tokens(model, ids, chunk_size=8, max_positions=11)
        torch.testing.assert_close(loss[:, 1:11], full_loss[:, 1:11], **TOL)
        assert torch.isnan(loss[:, 11:]).all()
    assert chunk_bounds(11, 5) == [(0, 5), (5, 11)]  # no one-token chunk at the end
    assert chunk_bounds(10, 5) == [(0, 5), (5, 10)] and chunk_bounds(3, 8) == [(0, 3)]


def test_log_bins():
    from hf_kernattn.evaluation import log_bins

    assert log_bins(2) == [1, 2]
    assert log_bins(48) == [1, 2, 4, 8, 16, 32, 48]
    assert log_bins(64) == [1, 2, 4, 8, 16, 32, 64]
    assert log_bins(16, per_octave=2) == [1, 2, 3, 4, 6, 8, 11, 16]
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        log_bins(1)


def _dense_shares(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, per head: the window's and the linear part's mean share over queries i >= W,
    from the N x N weights written out in float64 (hand-written projections, Llama's rotations,
    elu + 1 features, grouped keys repeated)."""
    from hf_kernattn.modeling.positional import apply_rotary, rotary_cos_sin

    cfg = model.config
    h, hkv, w = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.softmax_window
    d = cfg.hidden_size // h
    b, n = ids.shape
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states
        cos, sin = rotary_cos_sin(torch.arange(n)[None].expand(b, n), d, cfg.rotary_base, torch.float64)
        out = []
        for i, block in enumerate(model.transformer.h):
            x = block.ln_1(hidden[i])
            attn = block.attn
            heads = lambda t, k: t.view(b, n, k, d).transpose(1, 2)  # noqa: E731
            q = apply_rotary(heads(x @ attn.q_proj.weight.T + attn.q_proj.bias, h), cos, sin)
            k = apply_rotary(heads(x @ attn.k_proj.weight.T + attn.k_proj.bias, hkv), cos, sin)
            k = k.repeat_interleave(h // hkv, dim=1)
            phi = lambda t: F.elu(t) + 1  # noqa: E731
            a = attn.window_log_weight.exp().view(1, h, 1, 1)
            c = attn.linear_log_weight.exp().view(1, h, 1, 1)
            r = torch.arange(n)[None, :] - torch.arange(n)[:, None]
            window = (r <= 0) & (r > -w)
            linear = r <= -w
            # log of each part's total weight (log-sum-exp: exp(s) may overflow even float64)
            s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~window, -math.inf)
            log_win = a.log()[..., 0] + torch.logsumexp(s, dim=-1)
            log_lin = (c[..., 0] * torch.where(linear, phi(q) @ phi(k).transpose(-1, -2), 0.0).sum(-1)).log()
            share_w = torch.sigmoid(log_win - log_lin)[:, :, w:]  # A / (A + L)
            share_l = torch.sigmoid(log_lin - log_win)[:, :, w:]
            out.append((share_w.mean(dim=(0, 2)), share_l.mean(dim=(0, 2))))
    return out


def test_hybrid_shares_equal_a_dense_float64_computation():
    from hf_kernattn import LinearGPTForCausalLM
    from hf_kernattn.evaluation import hybrid_attention_modules, hybrid_shares
    from tests.conftest import tiny_linear_gpt_config

    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(
        vocab_size=V, softmax_window=4, feature_map="elu", position_embedding_type="rope", num_key_value_heads=1,
    )).double().eval()
    with torch.no_grad():  # mixing weights away from 1, different per head and layer
        for block in model.transformer.h:
            block.attn.window_log_weight.normal_(0, 1)
            block.attn.linear_log_weight.normal_(0, 1)
    assert [name for name, _ in hybrid_attention_modules(model)] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    ids = torch.randint(2, V, (2, 23), generator=torch.Generator().manual_seed(5))
    dense = _dense_shares(model, ids)
    for chunk in (5, 23):  # the keys carried between chunks give what one call gives
        layers = hybrid_shares(model, ids, chunk_size=chunk)
        assert len(layers) == 2
        for layer, (win, lin) in zip(layers, dense):
            assert layer["queries"] == 2 * (23 - 4)
            got_w = torch.tensor([x["window_share"] for x in layer["heads"]], dtype=torch.float64)
            got_l = torch.tensor([x["linear_share"] for x in layer["heads"]], dtype=torch.float64)
            torch.testing.assert_close(got_w, win, **TOL)
            torch.testing.assert_close(got_l, lin, **TOL)
            torch.testing.assert_close(got_w + got_l, torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-12)
            assert layer["window_share"] == pytest.approx(float(win.mean()), **APPROX)
    # a hybrid whose linear part weighs nothing puts all of its attention in the window
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.linear_log_weight.sub_(200.0)
    assert all(layer["window_share"] == pytest.approx(1.0, abs=1e-12) for layer in hybrid_shares(model, ids))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.linear_log_weight.add_(200.0)
    # scores beyond exp's range (float64 overflows above 709): the shares stay exact
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.q_proj.weight.mul_(200)
    dense = _dense_shares(model, ids)
    layers = hybrid_shares(model, ids, chunk_size=5)
    for layer, (win, lin) in zip(layers, dense):
        got_w = torch.tensor([x["window_share"] for x in layer["heads"]], dtype=torch.float64)
        torch.testing.assert_close(got_w, win, **TOL)
        assert 0 < float(win.min()) and float(win.max()) < 1  # neither part gone
    assert hybrid_shares(LinearGPTForCausalLM(tiny_linear_gpt_config(vocab_size=V)).eval(), ids) == []


def _error(argv, capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-kernattn: error: ") and "Traceback" not in err
    return err


def test_bad_input_is_one_clear_line(setup, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    text, gpt2 = str(setup["text"]), str(setup["gpt2"])
    ctx = ["-q", "eval", "context", "--out", str(tmp_path / "o"), "--device", "cpu"]
    err = _error([*ctx, gpt2, "--text", str(tmp_path / "missing.txt"), "--max_length", "8"], capsys)
    assert "missing.txt" in err and "does not exist" in err
    err = _error([*ctx, gpt2, "--text", text, "--max_length", "1"], capsys)
    assert "--max_length must be >= 2" in err
    err = _error([*ctx, str(tmp_path / "no_model"), "--text", text, "--max_length", "8"], capsys)
    assert "no_model" in err and "neither an existing folder nor a Hub model id" in err
    err = _error([*ctx, gpt2, "--text", text, "--max_length", "1000"], capsys)
    assert "too short" in err and "400 tokens" in err
    rec = ["-q", "eval", "recall", gpt2, "--text", text, "--out", str(tmp_path / "o"), "--device", "cpu"]
    err = _error([*rec, "--distances", "1000"], capsys)
    assert "too short" in err and "1000" in err
    small = tmp_path / "small_vocab"  # a model that cannot hold the tokenizer's 40 ids
    GPT2LMHeadModel(GPT2Config(vocab_size=30, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=1,
                               eos_token_id=1)).save_pretrained(small)
    capsys.readouterr()
    err = _error([*ctx, gpt2, str(small), "--text", text, "--max_length", "8"], capsys)
    assert "vocab_size=30" in err and "40 ids" in err
    err = _error([*ctx, str(small), "--text", text, "--max_length", "8"], capsys)
    assert "no tokenizer" in err and "--tokenizer" in err
    assert not (tmp_path / "o").exists()  # nothing written on bad input
