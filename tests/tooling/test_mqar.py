"""examples/research/mqar.py: the MQAR data are what the task says (pairs first, every key queried
once later, the answer its value, nothing else scored), deterministic per (seed, step); the
accuracy counts what an oracle gets right; and the script runs end to end at toy size."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.tooling.test_examples_resume import load_script


@pytest.fixture(scope="module")
def mqar():
    return load_script("mqar")


def test_generator_puts_pairs_first_and_each_answer_at_its_query(mqar):
    K, V, T, P = 10, 7, 40, 6
    ids, targets = mqar.mqar_batch(16, T, P, K, V, torch.Generator().manual_seed(0))
    assert ids.shape == targets.shape == (16, T)
    for b in range(16):
        keys, values = ids[b, 0:2 * P:2], ids[b, 1:2 * P:2]
        assert len(set(keys.tolist())) == P and keys.min() >= 1 and keys.max() <= K  # distinct keys in 1 .. K
        assert values.min() >= K + 1 and values.max() <= K + V  # values in their own range
        value_of = dict(zip(keys.tolist(), values.tolist()))
        scored = (targets[b] != -100).nonzero()[:, 0]
        assert len(scored) == P and bool((scored >= 2 * P).all()) and bool(((scored - 2 * P) % 2 == 0).all())
        asked = ids[b, scored].tolist()
        assert sorted(asked) == sorted(keys.tolist())  # every key queried once, after the pairs
        assert targets[b, scored].tolist() == [value_of[k] for k in asked]  # the answer: that key's value
        rest = torch.ones(T, dtype=torch.bool)
        rest[:2 * P] = False
        rest[scored] = False
        assert bool((ids[b, rest] == mqar.FILLER).all())  # filler elsewhere (the answers are not in the input)
    again = mqar.mqar_batch(16, T, P, K, V, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], ids) and torch.equal(again[1], targets)
    # fill: every slot after the pairs asks for a key of the pairs, each key at least once
    ids, targets = mqar.mqar_batch(8, T, P, K, V, torch.Generator().manual_seed(1), fill=True)
    for b in range(8):
        value_of = dict(zip(ids[b, 0:2 * P:2].tolist(), ids[b, 1:2 * P:2].tolist()))
        scored = (targets[b] != -100).nonzero()[:, 0]
        assert scored.tolist() == list(range(2 * P, T - 1, 2))  # (T - 2P) // 2 slots, all queried
        asked = ids[b, scored].tolist()
        assert set(asked) == set(value_of) and targets[b, scored].tolist() == [value_of[k] for k in asked]
        assert bool((ids[b, 2 * P + 1::2] == mqar.FILLER).all())
    with pytest.raises(ValueError, match="needs at least 4 \\* num_pairs"):
        mqar.mqar_batch(1, 4 * P - 1, P, K, V, torch.Generator())
    with pytest.raises(ValueError, match="num_pairs must be in"):
        mqar.mqar_batch(1, 100, K + 1, K, V, torch.Generator())


def test_training_batches_depend_on_seed_and_step_only(mqar):
    args = SimpleNamespace(seq_lens=[16, 32], pairs=[2, 4, 8], batch_size=3, num_keys=12, num_values=5, seed=1,
                           queries="once")
    assert mqar.grid(args.seq_lens, args.pairs) == [(16, 2), (16, 4), (32, 2), (32, 4), (32, 8)]
    later = mqar.train_batch(7, args)
    first = [mqar.train_batch(s, args) for s in range(8)]
    assert torch.equal(first[7][0], later[0]) and torch.equal(first[7][1], later[1])
    assert [b[2:] for b in first] == [(16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (16, 2), (16, 4), (32, 2)]
    assert not torch.equal(first[0][0], first[5][0])  # the same (T, P) again: fresh sequences
    args.seed = 2
    assert not torch.equal(mqar.train_batch(7, args)[0], later[0])
    # the learning rate: linear warm-up to the peak, cosine down to 0 at the last step
    assert [mqar.lr_factor(s, 4, 20) for s in (0, 3, 4, 12, 20)] == pytest.approx([0.25, 1.0, 1.0, 0.5, 0.0])


class _Oracle(torch.nn.Module):
    """Reads the pairs and puts all its logit mass on the value after the matching key;
    ``wrong_every``: answers with another value for every such query."""

    def __init__(self, vocab: int, wrong_every: int = 0):
        super().__init__()
        self.vocab, self.wrong_every = vocab, wrong_every

    def forward(self, input_ids, use_cache=False):
        b, n = input_ids.shape
        logits = torch.zeros(b, n, self.vocab)
        seen = 0
        for i in range(b):
            row = input_ids[i].tolist()
            pairs = {}
            for t in range(0, n - 1, 2):
                if row[t] and row[t + 1] and row[t] not in pairs:
                    pairs[row[t]] = row[t + 1]
            for t, tok in enumerate(row):
                if tok in pairs and t > 0 and row[t + 1 if t + 1 < n else t] == 0:
                    seen += 1
                    wrong = self.wrong_every and seen % self.wrong_every == 0
                    logits[i, t, pairs[tok] + (1 if wrong and pairs[tok] + 1 < self.vocab else -1 if wrong else 0)] = 10.0
        return SimpleNamespace(logits=logits)


def test_accuracy_counts_the_queries(mqar):
    args = SimpleNamespace(seed=0, eval_examples=10, batch_size=4, num_keys=8, num_values=6, queries="once")
    vocab = 1 + 8 + 6
    assert mqar.accuracy(_Oracle(vocab), 24, 4, args) == (1.0, 40)
    acc, queries = mqar.accuracy(_Oracle(vocab, wrong_every=4), 24, 4, args)
    assert queries == 40 and acc == pytest.approx(0.75)
    ids, targets = mqar.mqar_batch(4, 24, 4, 8, 6, torch.Generator().manual_seed(3))
    assert float(mqar.query_loss(_Oracle(vocab)(ids).logits, targets)) < 1e-3


def test_a_toy_run_writes_the_table_the_plot_and_every_setting(mqar, tmp_path):
    report = mqar.main(["--models", "softmax", "elu", "window4", "--widths", "8", "--layers", "1", "--heads", "2",
                        "--seq_lens", "16", "--pairs", "2", "4", "--num_keys", "6", "--num_values", "5", "--steps", "3",
                        "--warmup", "1", "--batch_size", "4", "--eval_examples", "3", "--log_every", "2",
                        "--num_random_features", "8", "--workers", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "mqar.json").read_text())
    assert saved == json.loads(json.dumps(report))
    s = saved["settings"]
    assert s["steps"] == 3 and s["lr"] == 1e-3 and s["batch_size"] == 4 and s["widths"] == [8]
    assert s["architecture"] == "llama" and s["queries"] == "all"
    assert s["train_grid"] == [[16, 2], [16, 4]] and s["eval_grid"] == [[16, 2], [16, 4]]
    assert s["vocab_size"] == 12 and s["chance_accuracy"] == pytest.approx(0.2)
    assert [r["model"] for r in saved["models"]] == ["softmax", "elu", "window4"]
    for r in saved["models"]:  # every slot queried: (16 - 2P) / 2 answers per sequence
        assert [(a["seq_len"], a["num_pairs"], a["queries"]) for a in r["accuracy"]] == [(16, 2, 18), (16, 4, 12)]
        assert all(0.0 <= a["accuracy"] <= 1.0 for a in r["accuracy"])
        assert [p[0] for p in r["loss_curve"]] == [2, 3] and r["train_seconds"] > 0 and r["parameters"] > 0
    cfgs = {r["model"]: r["config"] for r in saved["models"]}
    assert cfgs["softmax"]["model_type"] == "llama" and cfgs["elu"]["feature_map"] == "elu"
    assert cfgs["elu"]["position_embedding_type"] == "rope"  # the Llama layout: rotary positions
    assert cfgs["window4"]["softmax_window"] == 4 and cfgs["window4"]["feature_map"] == "hedgehog"
    # state per layer: the softmax model's KV cache at T = 16; elu: 2 heads x (4 x 4 + 4); the hybrid
    # adds 3 window slots of raw keys, features and values
    states = {r["model"]: r["state_floats_per_layer"] for r in saved["models"]}
    assert states == {"softmax": 2 * 16 * 8, "elu": 2 * (4 * 4 + 4), "window4": 2 * (8 * 4 + 8) + 2 * 3 * (4 + 8 + 4)}
    table = (tmp_path / "mqar.md").read_text()
    assert "| Llama (softmax) |" in table and "| hybrid, window 4 |" in table and "T=16 P=4" in table
    assert (tmp_path / "mqar.png").stat().st_size > 1000


def test_the_two_layouts_differ_only_in_attention(mqar):
    """With --architecture gpt2 the softmax model is GPT2LMHeadModel and Linear GPT takes GPT-2's
    layout; with llama, LlamaForCausalLM and Llama's: the same parameters outside attention."""
    base = ["--widths", "8", "--layers", "1", "--heads", "2", "--seq_lens", "16", "--pairs", "2", "--num_keys", "6",
            "--num_values", "5"]
    for arch, softmax_type, positions in (("gpt2", "gpt2", "absolute"), ("llama", "llama", "rope")):
        args = mqar.parse_args([*base, "--architecture", arch])
        softmax, linear = mqar.build_model("softmax", 8, args), mqar.build_model("elu", 8, args)
        assert softmax.config.model_type == softmax_type and linear.config.position_embedding_type == positions
        n_soft, n_lin = (sum(p.numel() for p in m.parameters()) for m in (softmax, linear))
        assert n_soft == n_lin, (arch, n_soft, n_lin)


def test_bad_settings_are_usage_errors(mqar, capsys):
    for argv, message in ((["--models", "lstm"], "unknown model 'lstm'"),
                          (["--seq_lens", "8", "--pairs", "4"], "no training (T, P)"),
                          (["--widths", "7"], "multiples of --heads"),
                          (["--steps", "0"], "--steps must be >= 1")):
        with pytest.raises(SystemExit):
            mqar.parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_worker_process_prints_its_one_record(mqar, capsys):
    """What each worker process of a parallel run does: train one model and print its record
    as one tagged JSON line, which the parent reads."""
    rec = mqar.main(["--job", "prf", "8", "--layers", "1", "--architecture", "gpt2", "--seq_lens", "16", "--pairs", "2", "--num_keys", "4",
                     "--num_values", "3", "--steps", "2", "--batch_size", "2", "--eval_examples", "2",
                     "--num_random_features", "4", "--out", "unused"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(mqar.RESULT_TAG)]
    assert len(line) == 1 and json.loads(line[0][len(mqar.RESULT_TAG):]) == json.loads(json.dumps(rec))
    assert rec["model"] == "prf" and rec["width"] == 8 and rec["config"]["num_random_features"] == 4
