"""Attention transfer from a Llama with grouped-query attention and rotary positions, and from a
BERT classifier on padded sentence pairs: the transfer loss falls, each student layer reads the
teacher's input to it (and, for BERT, the padding mask), the saved models reload (also in a
process without hf_kernattn), and bad input is refused before anything is written."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from hf_kernattn.convert.linearize import (
    attention_pairs,
    linearize,
    pad_sequences,
    read_texts,
    token_sequences,
    transfer_hooks,
    transfer_loss,
)
from tests.reference import assert_reordered_close
from tests.remote import causal_lm_logits_without_package, run_without_package

V = 40
WORDS = [f"w{i}" for i in range(2, V)]


def _word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{w: i for i, w in enumerate(WORDS, 2)}}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)


def _sentences(n, seed, low=3, high=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g)) for k in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama: 4 query heads sharing 2 key/value heads, rotary positions, peaked attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rope_theta=500.0, initializer_range=0.3, bos_token_id=1, eos_token_id=1,
                                 pad_token_id=1)).save_pretrained(folder)
    _word_tokenizer(folder)
    text = folder / "train.txt"
    text.write_text(" ".join(_sentences(400, 1)))
    return folder, text


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT sequence classifier, its WordPiece vocabulary and a CSV of sentence pairs of
    different lengths (so that batches are padded)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    folder = tmp_path_factory.mktemp("bert")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=False)
    assert len(tok) == 5 + len(WORDS)
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                             initializer_range=0.3)).save_pretrained(folder)
    tok.save_pretrained(folder)
    data = folder / "pairs.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "label"])
        for i, (a, b) in enumerate(zip(_sentences(200, 2), _sentences(200, 3))):
            w.writerow([a, b, i % 2])
    return folder, data


def test_llama_gqa_rope_transfer_lowers_the_loss_and_reloads_without_the_package(llama, tmp_path):
    folder, text = llama
    model = linearize(folder, tmp_path / "out", train_files=[str(text)], steps=16, batch_size=4, block_size=16,
                      learning_rate=3e-2, progress=False)
    report, cfg = model.linearize_report, model.config
    # (measured: 3.45 -> 3.26 after 12 steps, 3.05 after 60; the same with 4 key/value heads)
    assert sum(report["layer_loss_after"]) < 0.97 * sum(report["layer_loss_before"])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.position_embedding_type) == (4, 2, "rope")
    fm = model.transformer.h[0].attn.feature_map
    assert tuple(fm.query_weight.shape) == (4, 8, 8) and tuple(fm.key_weight.shape) == (2, 8, 8)  # keys per kv head
    ids = torch.randint(2, V, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    with torch.no_grad():  # the same mode as ``want`` (auto ranks forward and training calls apart)
        torch.testing.assert_close(again(ids, use_cache=False).logits, want, rtol=0, atol=0)
    got = torch.tensor(causal_lm_logits_without_package("out", ids, tmp_path))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_llama_hooks_feed_the_teachers_input_with_rotary_positions(llama):
    from transformers import LlamaForCausalLM

    from hf_kernattn.convert import convert

    folder, _ = llama
    teacher = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    student = convert(folder, None, feature_map="hedgehog").eval()
    pairs = attention_pairs(teacher, student, "llama")
    ids = torch.randint(2, V, (2, 12), generator=torch.Generator().manual_seed(5))
    seen = {}  # what each student layer is called with, after the transfer hook's substitution

    def capture(i):
        def hook(module, args, kwargs):
            seen[i] = (args, kwargs)
        return hook

    with torch.no_grad(), transfer_hooks(pairs) as (t_out, s_out):
        handles = [attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, (_, _, attn) in enumerate(pairs)]
        teacher(input_ids=ids, use_cache=False)
        student(input_ids=ids, use_cache=False)
        for h in handles:
            h.remove()
    with torch.no_grad():
        hidden = teacher(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    for i, (_, _, attn) in enumerate(pairs):
        args, kwargs = seen[i]
        # the teacher's normed input to its attention, the student's own rotary positions 0..N-1
        with torch.no_grad():
            torch.testing.assert_close(args[0], teacher.model.layers[i].input_layernorm(hidden[i]), rtol=0, atol=0)
            cos, sin = kwargs["rotary"]
            assert cos.shape[-2] == 12
            again = attn(*args, **kwargs)
        torch.testing.assert_close(s_out[i], again, rtol=0, atol=0)
        assert t_out[i].shape == s_out[i].shape == (2, 12, 32)


def _bert_batch(folder, pairs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return pad_sequences(token_sequences(tok, pairs, 64), tok.pad_token_id)


@pytest.mark.parametrize("window", [None, 3], ids=["linear", "window3"])
def test_bert_student_layers_read_the_teachers_input_and_the_padding_mask(bert, window):
    """Also with the bidirectional sliding-window hybrid: padded keys count neither inside the
    window nor beyond it."""
    from transformers import BertModel

    from hf_kernattn.convert import convert

    folder, data = bert
    pairs = read_texts([str(data)], text_column="sentence1", text_pair_column="sentence2")[:4]
    assert all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
    batch = _bert_batch(folder, pairs)
    mask = batch["attention_mask"]
    assert (mask == 0).any() and (mask.sum(1) < mask.shape[1]).sum() == 3  # padded: all but the longest
    assert batch["token_type_ids"].max() == 1  # second segments marked
    teacher = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    kw = {} if window is None else {"softmax_window": window, "rpe": "none"}
    student = convert(folder, None, feature_map="hedgehog_exp", normalize_qk=False, **kw).eval()
    assert student.config.softmax_window == window
    torch.manual_seed(1)
    with torch.no_grad():  # make the learned map and the mixing weights non-trivial
        for name, p in student.named_parameters():
            if name.endswith(("query_weight", "window_log_weight", "linear_log_weight")):
                p.add_(0.3 * torch.randn_like(p))
    tpairs = attention_pairs(teacher, student, "bert")
    with torch.no_grad(), transfer_hooks(tpairs) as (t_out, s_out):
        teacher(**batch)
        student(**batch)
        loss, per_layer = transfer_loss(t_out, s_out, mask)
        hidden = teacher(**batch, output_hidden_states=True).hidden_states
    rpe = student.nprf_bert.rpe  # the model's shared bias table, passed as the model passes it
    bias = {} if rpe is None else dict(rpe_bias=rpe.weight, rpe_clip=student.config.max_relative_position)
    for i, (_, _, attn) in enumerate(tpairs):
        with torch.no_grad():  # the student's layer on the teacher's input to it, with the padding mask
            again = attn(hidden[i], attention_mask=mask, **bias)
        torch.testing.assert_close(s_out[i], again, rtol=0, atol=0)
    # every example alone (no padding) gives the same attention outputs at its real positions, in
    # the teacher and the student: the padded keys count for nothing in either
    for b in range(len(pairs)):
        alone = _bert_batch(folder, pairs[b:b + 1])
        n = int(mask[b].sum())
        with torch.no_grad(), transfer_hooks(tpairs) as (t1, s1):
            teacher(**alone)
            student(**alone)
        for i in range(len(tpairs)):  # float32, another batch shape: reordered sums through layers 0..i
            terms = max(teacher.config.intermediate_size, mask.shape[1])
            assert_reordered_close(t1[i][0], t_out[i][b, :n], terms=terms, layers=4 * (i + 1))
            assert_reordered_close(s1[i][0], s_out[i][b, :n], terms=terms, layers=4 * (i + 1))
    # the loss reads real positions only: the mean over them, per layer
    real = mask.bool()
    for i in range(len(tpairs)):
        assert per_layer[i] == pytest.approx(float(((s_out[i] - t_out[i])[real] ** 2).mean()), rel=1e-5)
    assert float(loss) == pytest.approx(sum(per_layer) / len(per_layer))


def test_bert_pair_transfer_lowers_the_loss_saves_and_reloads_without_the_package(bert, tmp_path):
    folder, data = bert
    out = tmp_path / "out"
    model = linearize(folder, out, train_files=[str(data)], text_column="sentence1", text_pair_column="sentence2",
                      steps=15, batch_size=8, block_size=32, learning_rate=2e-2, progress=False)
    report = model.linearize_report
    assert type(model).__name__ == "NPRFBertForSequenceClassification"
    assert model.config.feature_map == "hedgehog" and model.config.normalize_qk is False
    assert report["recipe"]["line_by_line"] and report["recipe"]["text_pair_column"] == "sentence2"
    assert report["recipe"]["blocks"] == 200  # one sequence per row
    assert sum(report["layer_loss_after"]) < 0.9 * sum(report["layer_loss_before"])
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()) and not (out / ".linearize-result.tmp").exists()
    assert json.loads((out / "linearize_report.json").read_text())["recipe"]["steps"] == 15
    batch = _bert_batch(folder, [("w2 w3 w4 w5 w6", "w7 w8"), ("w9 w10", "w11")])
    with torch.no_grad():
        want = model(**batch).logits
    from transformers import AutoModelForSequenceClassification

    again = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, want, rtol=0, atol=0)
    code = f"""
import json, torch, transformers
m = transformers.AutoModelForSequenceClassification.from_pretrained("out", trust_remote_code=True).eval()
batch = {{k: torch.tensor(v) for k, v in {json.dumps({k: v.tolist() for k, v in batch.items()})}.items()}}
with torch.no_grad():
    print(json.dumps(m(**batch).logits.tolist()))
"""
    got = torch.tensor(json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a second run into the same folder replaces the result (the report written last)
    linearize(folder, out, train_files=[str(data)], text_column="sentence1", text_pair_column="sentence2",
              steps=2, batch_size=8, block_size=32, progress=False)
    assert json.loads((out / "linearize_report.json").read_text())["recipe"]["steps"] == 2
    assert not (out / ".linearize-result.tmp").exists()


def test_plain_text_line_by_line_pads_single_sentences(bert, tmp_path):
    folder, _ = bert
    text = tmp_path / "lines.txt"
    text.write_text("\n".join(_sentences(30, 7)) + "\n\n")
    assert len(read_texts([str(text)], line_by_line=True)) == 30  # blank lines skipped
    model = linearize(folder, tmp_path / "out", train_files=[str(text)], line_by_line=True, steps=3, batch_size=4,
                      block_size=16, progress=False)
    assert model.linearize_report["recipe"]["blocks"] == 30


def _nothing_written(tmp_path, name="out"):
    return not (tmp_path / name).exists() and not any(".tmp" in p.name for p in tmp_path.iterdir())


def test_bad_input_is_refused_before_anything_is_written(bert, llama, tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    folder, data = bert
    # a source the recipe does not support
    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                        d_kv=8)).save_pretrained(t5)
    with pytest.raises(ValueError, match="cannot convert model_type='t5'.*supported source architectures"):
        linearize(t5, tmp_path / "out", train_files=[str(data)], steps=2, block_size=16)
    assert _nothing_written(tmp_path)
    # data that cannot be read: not UTF-8, malformed CSV, a column that is not there, a plain-text
    # file where pairs are asked for, no text at all
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"w2 w3\n\xff\xfe w4\n")
    with pytest.raises(ValueError, match=r"bad\.txt, line 2: not UTF-8"):
        linearize(folder, tmp_path / "out", train_files=[str(bad)], line_by_line=True, steps=2, block_size=16)
    broken = tmp_path / "broken.json"
    broken.write_text('{"sentence1": "w2 w3"}\n{"sentence1": \n')
    with pytest.raises(ValueError, match=r"broken\.json.*cannot be read as JSON"):
        linearize(folder, tmp_path / "out", train_files=[str(broken)], text_column="sentence1", steps=2, block_size=16)
    with pytest.raises(ValueError, match=r"pairs\.csv.* has no column 'question'; its columns"):
        linearize(folder, tmp_path / "out", train_files=[str(data)], text_column="sentence1",
                  text_pair_column="question", steps=2, block_size=16)
    with pytest.raises(ValueError, match="text_pair_column needs table train files"):
        linearize(folder, tmp_path / "out", train_files=[str(llama[1])], text_pair_column="b", steps=2, block_size=16)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="holds no text"):
        linearize(folder, tmp_path / "out", train_files=[str(empty)], steps=2, block_size=16)
    assert _nothing_written(tmp_path)
    # an output path that is a file
    taken = tmp_path / "taken"
    taken.write_text("x")
    with pytest.raises(ValueError, match="output_dir .* is not a folder"):
        linearize(folder, taken, train_files=[str(data)], text_column="sentence1", steps=2, block_size=16)
    assert taken.read_text() == "x"


def test_command_line_sentence_pairs(bert, tmp_path, capsys):
    from hf_kernattn.cli import main

    folder, data = bert
    code = main(["-q", "linearize", str(folder), str(tmp_path / "cli"), "--train_file", str(data), "--text_column",
                 "sentence1", "--text_pair_column", "sentence2", "--steps", "2", "--batch_size", "4", "--block_size", "24"])
    assert code == 0 and "saved to" in capsys.readouterr().out
    recipe = json.loads((tmp_path / "cli" / "linearize_report.json").read_text())["recipe"]
    assert recipe["text_pair_column"] == "sentence2" and recipe["blocks"] == 200
    assert main(["linearize", str(folder), str(tmp_path / "bad"), "--train_file", str(data), "--text_column", "nope",
                 "--steps", "2", "--block_size", "16"]) == 1
    assert "has no column 'nope'" in capsys.readouterr().err and not (tmp_path / "bad").exists()
