"""Users' files -> entries -> the prompts table, for each format and layout the field uses, with
the SmolLM2 tokenizer's chat template (tiny_model fixture)."""
from __future__ import annotations

import copy
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.data.files import FileDataset
from rft_core.data.mixture import open_data
from rft_core.data.prompts import DatasetError, build_prompts
from schemas.columns import PROMPTS

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"  # what the template adds without a system turn


@pytest.fixture(scope="module")
def tok(tiny_model):
    from rft_core.models.loading import load_tokenizer

    return load_tokenizer(tiny_model)


def _chat(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _table(entries, tok, **kw):
    kw.setdefault("system_prompt", "")
    return build_prompts(entries, tok, data_source="ds", max_prompt_tokens=10_000, **kw).table.to_pylist()


def test_verl_parquet_keeps_messages_labels_and_metadata(tmp_path, tok):
    shots = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"},
             {"role": "assistant", "content": "Answer: 2"}]
    rows = [{"data_source": "gsm8k", "prompt": shots + [{"role": "user", "content": "What is 2 + 3?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "train", "index": 0}},
            {"data_source": "math", "prompt": [{"role": "user", "content": "What is 4 * 4?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "16"}, "extra_info": {"split": "train", "index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    ds = open_data(str(tmp_path / "train.parquet"))
    assert (ds.format, ds.layout.style, ds.layout.prompt_kind, len(ds)) == ("parquet", "verl", "messages", 2)
    out = _table(ds.entries([0, 1]), tok, system_prompt="IGNORED FOR MESSAGES")
    assert [r["question"] for r in out] == ["What is 2 + 3?", "What is 4 * 4?"]
    assert [r["answer"] for r in out] == ["5", "16"]
    assert [r["data_source"] for r in out] == ["gsm8k", "math"]
    assert [r["prompt_id"] for r in out] == ["ds-000000", "ds-000001"]
    assert json.loads(out[0]["metadata_json"]) == {"ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
                                                   "extra_info": {"split": "train", "index": 0}}
    assert out[0]["prompt_text"] == _chat(tok, rows[0]["prompt"])  # few-shot turns and system kept, as given
    assert "Be brief." in out[0]["prompt_text"] and "Answer: 2" in out[0]["prompt_text"]
    assert "IGNORED" not in out[0]["prompt_text"]
    assert out[0]["prompt_token_ids"] == tok(out[0]["prompt_text"], add_special_tokens=False)["input_ids"]
    assert SMOL_DEFAULT_SYSTEM in out[1]["prompt_text"]  # no system turn: the template's own default, untouched
    assert out[0]["images"] == [] and set(out[0]) == set(PROMPTS.schema.names)


def test_trl_standard_jsonl_gets_system_prompt(tmp_path, tok):
    lines = [{"prompt": "What is 2 + 2?", "completion": "4", "difficulty": 1},
             {"prompt": "What is 9 - 3?", "completion": "6", "difficulty": 2}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = open_data(str(tmp_path / "d.jsonl"))
    assert (ds.format, ds.layout.style, ds.layout.columns) == ("jsonl", "trl_standard", {"prompt": "prompt", "answer": "completion"})
    out = _table(ds.entries([1]), tok, system_prompt="Solve it.")
    assert out[0]["prompt_text"] == _chat(tok, [{"role": "system", "content": "Solve it."},
                                                {"role": "user", "content": "What is 9 - 3?"}])
    assert (out[0]["answer"], out[0]["data_source"], json.loads(out[0]["metadata_json"])) == ("6", "d", {"difficulty": 2})
    assert out[0]["prompt_id"] == "ds-000001"


def test_trl_conversational_jsonl_with_content_parts(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "Add 2 and 5."}], "solution": "7"},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "1 and 1."}]}],
             "solution": "2"}]
    (tmp_path / "c.jsonl").write_text(json.dumps(rows[0]) + "\n")
    ds = open_data(str(tmp_path / "c.jsonl"))
    assert ds.layout.style == "trl_conversational"
    out = _table(ds.entries([0]), tok)
    assert out[0]["prompt_text"] == _chat(tok, rows[0]["prompt"]) and out[0]["answer"] == "7"
    (tmp_path / "c.json").write_text("\n".join(json.dumps(r) for r in rows))  # .json holding JSON Lines
    with pytest.raises(DatasetError, match=r"c.json row 1 \(line 2\) column 'prompt\[\].content': mixed types, array "
                                           "here but string in row 0"):
        open_data(str(tmp_path / "c.json"))
    (tmp_path / "c.json").write_text(json.dumps(rows[1]))
    (_, e), = open_data(str(tmp_path / "c.json")).entries([0])
    assert e["messages"] == [{"role": "user", "content": "Add 1 and 1."}] and e["question"] == "Add 1 and 1."


def test_plain_csv_keeps_text_answers_and_quoted_newlines(tmp_path, tok):
    (tmp_path / "p.csv").write_bytes(b'question,answer,topic\n"Line one\nline two: 5 + 2?",007,add\nWhat is 1/2?,0.50,div\n')
    ds = FileDataset(str(tmp_path / "p.csv"))
    assert (ds.format, ds.layout.style, len(ds)) == ("csv", "plain", 2)
    out = _table(ds.entries([0, 1]), tok)
    assert [r["question"] for r in out] == ["Line one\nline two: 5 + 2?", "What is 1/2?"]
    assert [r["answer"] for r in out] == ["007", "0.50"]
    assert [json.loads(r["metadata_json"]) for r in out] == [{"topic": "add"}, {"topic": "div"}]
    assert out[1]["prompt_text"] == _chat(tok, [{"role": "user", "content": "What is 1/2?"}])


def test_json_array_numbers_become_answer_text(tmp_path):
    data = [{"question": "a?", "answer": 4}, {"question": "b?", "answer": 2.5}]
    (tmp_path / "a.json").write_text(json.dumps(data, indent=1))
    ds = open_data(str(tmp_path / "a.json"))
    assert ds.format == "json"
    # JSON numbers mixing 4 and 2.5 become doubles; integral ones print as integers
    assert [e["answer"] for _, e in ds.entries([0, 1])] == ["4", "2.5"]
    (tmp_path / "l.json").write_text(json.dumps([{"question": "c?", "answer": [1, 2]}, {"question": "d?", "answer": [3]}]))
    assert [e["answer"] for _, e in open_data(str(tmp_path / "l.json")).entries([0, 1])] == ["[1, 2]", "[3]"]


def test_mapping_with_nested_columns_overrides_detection(tmp_path, tok):
    rows = [{"input": "Q1", "question": "not this", "meta": {"label": "A1", "level": 3}, "src": "mine"}]
    (tmp_path / "o.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cols = {"prompt": "input", "answer": "meta.label", "data_source": "src"}
    ds = open_data(str(tmp_path / "o.jsonl"), columns=cols)
    assert ds.layout.style == "mapped" and ds.layout.columns == cols
    (i, e), = ds.entries([0])
    assert (e["question"], e["answer"], e["data_source"]) == ("Q1", "A1", "mine")
    assert e["metadata"] == {"question": "not this", "meta": {"label": "A1", "level": 3}}  # only directly mapped columns leave
    assert _table([(i, e)], tok)[0]["data_source"] == "mine"
    # the same with a source-level label: it wins, the file's own label stays in metadata
    (_, e), = FileDataset(str(tmp_path / "o.jsonl"), columns=cols, data_source="override").entries([0])
    assert e["data_source"] == "override" and e["metadata"]["data_source"] == "mine"


def test_glob_folder_and_memory_uri(tmp_path):
    import fsspec

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.jsonl").write_text('{"question": "b0", "answer": "1"}\n{"question": "b1", "answer": "2"}\n')
    (tmp_path / "d" / "a.jsonl").write_text('{"question": "a0", "answer": "3"}\n')
    (tmp_path / "d" / "_SUCCESS").write_text("")
    for path in (str(tmp_path / "d"), str(tmp_path / "d" / "*.jsonl"), f"file://{tmp_path}/d"):
        ds = open_data(path)
        assert len(ds) == 3 and [e["question"] for _, e in ds.entries([0, 1, 2])] == ["a0", "b0", "b1"]
        assert ds.where(2) == f"{tmp_path}/d/b.jsonl line 2 (row 1)"
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["m0", "m1"], "answer": ["x", "y"]}), buf)
    fsspec.filesystem("memory").pipe("/rft-test/m.parquet", buf.getvalue())
    ds = open_data("memory://rft-test/m.parquet")
    assert ds.where(1) == "memory:///rft-test/m.parquet row 1"
    assert [(i, e["question"], e["answer"]) for i, e in ds.entries([1, 0])] == [(1, "m1", "y"), (0, "m0", "x")]


def test_datasets_save_to_disk_folder(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"problem": ["p0", "p1"], "solution": ["s0", "s1"]}).save_to_disk(str(tmp_path / "hf"))
    ds = open_data(str(tmp_path / "hf"))
    assert (ds.format, len(ds), ds.layout.columns) == ("hf_disk", 2, {"prompt": "problem", "answer": "solution"})
    assert [e["answer"] for _, e in ds.entries([1, 0])] == ["s1", "s0"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": ["q"], "answer": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"DatasetDict with splits \['train'\].*dd/train"):
        open_data(str(tmp_path / "dd"))
    assert len(open_data(str(tmp_path / "dd" / "train"))) == 1


def test_save_to_disk_folder_is_read_with_pyarrow_alone(tmp_path, monkeypatch):
    """Shards, a shuffled selection, image features and a remote URI, with ``datasets`` not
    importable: the same table as ``datasets.load_from_disk(...).data.table``."""
    import sys

    import datasets
    import fsspec

    from rft_core.data.readers import read_hf_disk

    full = datasets.Dataset.from_dict({"question": [f"q{i}" for i in range(10)], "answer": [str(i) for i in range(10)],
                                       "image": [{"bytes": _png((i, 0, 0)), "path": None} for i in range(10)]},
                                      features=datasets.Features({"question": datasets.Value("string"),
                                                                  "answer": datasets.Value("string"),
                                                                  "image": datasets.Image()}))
    full.shuffle(seed=1).select(range(7)).save_to_disk(str(tmp_path / "hf"), num_shards=3)
    expected = datasets.load_from_disk(str(tmp_path / "hf")).data.table
    (tmp_path / "bad").mkdir()
    for name in ("state.json", "dataset_info.json"):
        (tmp_path / "bad" / name).write_text((tmp_path / "hf" / name).read_text())
    for i in range(3):
        (tmp_path / "bad" / f"data-0000{i}-of-00003.arrow").write_bytes(b"not arrow")
    mem = fsspec.filesystem("memory")
    for f in (tmp_path / "hf").iterdir():
        mem.pipe(f"/rft-hf/{f.name}", f.read_bytes())

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    table = read_hf_disk(str(tmp_path / "hf"))
    assert table.equals(expected) and table.column("question").to_pylist() == expected.column("question").to_pylist()
    assert read_hf_disk("memory://rft-hf").equals(expected)
    ds = open_data(str(tmp_path / "hf"))
    assert len(ds) == 7 and [e["question"] for _, e in ds.entries(range(7))] == expected.column("question").to_pylist()
    with pytest.raises(DatasetError, match=r"bad/data-00000-of-00003.arrow: not a readable Arrow stream file"):
        read_hf_disk(str(tmp_path / "bad"))
    (tmp_path / "bad" / "state.json").write_text("{}")
    with pytest.raises(DatasetError, match=r"bad: not a readable datasets.save_to_disk folder.*KeyError"):
        read_hf_disk(str(tmp_path / "bad"))


def _png(color) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (2, 2), color).save(buf, format="PNG")
    return buf.getvalue()


def test_images_relative_uri_and_bytes_resolve(tmp_path):
    import fsspec

    from rft_core.data.images import to_image_bytes

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png("red"))
    fsspec.filesystem("memory").pipe("/rft-test/b.png", _png("blue"))
    table = pa.table({"question": ["q0", "q1"], "answer": ["a", "b"],
                      "images": [[{"bytes": None, "path": "imgs/a.png"}, {"bytes": _png("green"), "path": None}],
                                 [{"bytes": None, "path": "memory://rft-test/b.png"}]],
                      "videos": [["clips/v.mp4"], []]})
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "v.mp4").write_bytes(b"not decoded here")
    pq.write_table(table, tmp_path / "vl.parquet")
    (_, e0), (_, e1) = open_data(str(tmp_path / "vl.parquet")).entries([0, 1])
    assert e0["images"][0] == str(tmp_path / "imgs" / "a.png") and e0["images"][1] == _png("green")
    assert e1["images"] == [_png("blue")]  # a non-local URI is read into bytes
    assert [to_image_bytes(x) for x in e0["images"]] == [_png("red"), _png("green")]
    assert e0["videos"] == [str(tmp_path / "clips" / "v.mp4")] and e1["videos"] == []


def test_videos_need_the_videos_column_and_a_vision_language_policy(tmp_path, tok):
    import numpy as np

    from rft_core.data.video import encode_video

    (tmp_path / "v.mp4").write_bytes(encode_video(np.zeros((2, 8, 8, 3), np.uint8), fps=2))
    entry = {"question": "what happens?", "answer": "x", "videos": [str(tmp_path / "v.mp4")]}
    with pytest.raises(DatasetError, match=r"ds row 0 has 1 video\(s\) but the policy is a text-only model"):
        _table([(0, entry)], tok)
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(DatasetError, match=r"ds row 0 video 0 \(.*bad.mp4\): not a decodable video \(11 bytes\)"):
        _table([(0, {**entry, "videos": [str(tmp_path / "bad.mp4")]})], tok)


def test_vision_language_placeholders_in_messages():
    from rft_core.data.prompts import _with_placeholders
    from rft_core.models.vl import IMAGE_PLACEHOLDER as IMG
    from rft_core.models.vl import VIDEO_PLACEHOLDER as VID

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<image> then <image>: same?"}]
    assert _with_placeholders(msgs, 2, 0, "w")[1]["content"] == f"{IMG} then {IMG}: same?"  # verl's markers, in place
    assert msgs[1]["content"] == "<image> then <image>: same?"  # the input is not changed
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "what?"}, {"role": "user", "content": "more"}]
    out = _with_placeholders(plain, 1, 1, "w")
    assert [m["content"] for m in out] == ["s", f"{IMG}{VID}what?", "more"]  # no markers: before the first user text
    with pytest.raises(DatasetError, match="w: the messages have 2 <image> markers but the row has 1 images"):
        _with_placeholders(msgs, 1, 0, "w")


def test_prompt_template_for_a_tokenizer_without_chat_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    entry = {"question": "What is 2 + 2?", "answer": "4"}
    with pytest.raises(DatasetError, match="ds row 3: the tokenizer has no chat template; set data.prompt_template"):
        _table([(3, entry)], plain)
    out = _table([(3, entry)], plain, prompt_template="Question: {prompt}\nAnswer:")[0]
    assert out["prompt_text"] == "Question: What is 2 + 2?\nAnswer:"
    assert out["prompt_token_ids"] == plain("Question: What is 2 + 2?\nAnswer:")["input_ids"]
    with pytest.raises(DatasetError, match="bad placeholder 'question'"):
        _table([(3, entry)], plain, prompt_template="Q: {question}")
    with pytest.raises(DatasetError, match="list of chat messages, which data.prompt_template cannot render"):
        _table([(3, {**entry, "messages": [{"role": "user", "content": "hi"}]})], plain, prompt_template="{prompt}")


def test_verl_image_rows_through_a_vision_language_processor(tmp_path):
    from rft_core.models.tiny_vl import build_tiny_qwen2_vl
    from rft_core.models.vl import IMAGE_PLACEHOLDER, VLProcessor

    proc = VLProcessor(build_tiny_qwen2_vl(tmp_path / "tiny-vl"))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png("red"))
    rows = [{"prompt": [{"role": "user", "content": "<image>Which colour?"}], "answer": "red", "images": ["imgs/a.png"]},
            {"prompt": [{"role": "user", "content": "No picture: 1 + 1?"}], "answer": "2", "images": []}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "vl.parquet")
    entries = open_data(str(tmp_path / "vl.parquet")).entries([0, 1])
    out = build_prompts(entries, None, data_source="vl", system_prompt="", max_prompt_tokens=1000, processor=proc).table.to_pylist()
    want = proc.tokenizer.apply_chat_template([{"role": "user", "content": f"{IMAGE_PLACEHOLDER}Which colour?"}],
                                              add_generation_prompt=True, tokenize=False)
    assert out[0]["prompt_text"] == want and out[0]["images"] == [_png("red")]  # the file's bytes, stored as they are
    assert out[0]["prompt_token_ids"].count(proc.image_token_id) == 4  # a 2x2 image is resized to 56x56: 4 tokens
    assert out[1]["images"] == [] and proc.image_token_id not in out[1]["prompt_token_ids"]
