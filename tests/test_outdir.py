"""`--overwrite` replaces only what this tool wrote (common/outdir.py): the owner record, the
files it lists at their sizes, directories written before records existed, and the second
look just before the rename. Every refusal leaves the directory exactly as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.common.outdir import OWNER, check_out_dir, foreign_files, replace_dir, sign
from infer_tool.packers.checkpoint import CHECKPOINT_FILES, REPORT_KEYS, REPORT_NAME, check_checkpoint_out

REPORT = json.dumps({"model": "m", "method": "rtn", "scheme": {}, "format": "compressed-tensors"})


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _ours(directory: Path) -> Path:
    """A checkpoint directory as a run leaves it: files, then the owner record, then the report."""
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"\0" * 100)
    (directory / "tokenizer.json").write_text("{}")
    sign(directory, "checkpoint", REPORT_NAME)
    (directory / REPORT_NAME).write_text(REPORT)  # rewritten after signing, at another size
    return directory


def _refused(out: Path, needle: str) -> None:
    before = _tree(out)
    with pytest.raises(BadInput, match=needle) as e:
        check_checkpoint_out(out, overwrite=True)
    assert "\n" not in str(e.value)
    assert _tree(out) == before


def test_a_plain_text_file_named_like_the_report_does_not_make_a_directory_ours(tmp_path):
    """The reported data loss: thesis.tex beside a text file called quantize_report.json."""
    out = tmp_path / "work"
    out.mkdir()
    (out / "thesis.tex").write_text(r"\documentclass{article}")
    (out / REPORT_NAME).write_text("notes about quantization")
    _refused(out, r"did not write \(thesis\.tex\)")
    (out / "thesis.tex").unlink()  # the report alone, not one of ours, is not ours either
    _refused(out, "quantize_report.json, not a document this tool wrote")


def test_our_directory_is_replaceable_and_a_file_added_to_it_is_named(tmp_path):
    out = _ours(tmp_path / "ck")
    check_checkpoint_out(out, overwrite=True)  # ours: accepted
    (out / "notes.md").write_text("mine")
    _refused(out, r"did not write \(notes\.md\)")
    (out / "notes.md").unlink()
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"1")
    _refused(out, r"sub/, sub/data\.bin")


def test_a_file_of_ours_changed_by_the_user_is_not_ours_any_more(tmp_path):
    out = _ours(tmp_path / "ck")
    (out / "tokenizer.json").write_text('{"edited": "by hand"}')
    _refused(out, r"did not write \(tokenizer\.json\)")


def test_out_that_is_a_link_is_refused(tmp_path):
    target = _ours(tmp_path / "ck")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(BadInput, match="is a symbolic link"):
        check_checkpoint_out(tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink() and (target / "config.json").is_file()


def test_links_are_named_not_followed(tmp_path):
    out = _ours(tmp_path / "ck")
    target = tmp_path / "precious"
    target.mkdir()
    (target / "a.txt").write_text("keep")
    os.symlink(target, out / "link")
    _refused(out, r"did not write \(link\)")
    assert (target / "a.txt").read_text() == "keep"


def test_a_forged_or_damaged_owner_record_is_itself_foreign(tmp_path):
    out = _ours(tmp_path / "ck")
    (out / OWNER).write_text('{"writer": "someone else", "files": {}}')
    _refused(out, r"did not write \(\.infer-tool\.json\)")
    (out / OWNER).write_text("[" * 100_000)  # nesting beyond the parser's recursion limit
    _refused(out, r"did not write \(\.infer-tool\.json\)")
    (out / OWNER).write_text(json.dumps({"writer": "infer-tool", "files": {"config.json": -1}}))
    _refused(out, r"\.infer-tool\.json")


def test_a_directory_written_before_owner_records_is_recognised_by_its_names(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "merges.txt"):
        (out / name).write_text("x")
    (out / REPORT_NAME).write_text(REPORT)
    check_checkpoint_out(out, overwrite=True)
    (out / REPORT_NAME).write_text(json.dumps({"model": "m"}))  # not the report's keys
    _refused(out, "not a document this tool wrote")
    (out / REPORT_NAME).write_text(REPORT)
    (out / "model-1.safetensors").write_text("x")  # not a name the writer uses
    _refused(out, r"model-1\.safetensors")


def test_refusal_lists_a_few_and_counts_the_rest(tmp_path):
    out = tmp_path / "many"
    out.mkdir()
    for i in range(9):
        (out / f"f{i}.txt").write_text("x")
    assert foreign_files(out, REPORT_NAME, CHECKPOINT_FILES, REPORT_KEYS).endswith("and 4 more")


def test_empty_directory_and_the_other_rules(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    check_checkpoint_out(empty, overwrite=True)
    with pytest.raises(BadInput, match="already exists"):
        check_checkpoint_out(empty, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="is a file"):
        check_checkpoint_out(tmp_path / "file", overwrite=True)
    src = _ours(tmp_path / "src")
    with pytest.raises(BadInput, match="source model"):
        check_checkpoint_out(src, overwrite=True, src_dir=src)


def test_files_that_appear_during_the_run_stop_the_replacement(tmp_path):
    """The second look: `replace_dir` refuses when the user put a file into --out after the first
    check, and leaves both the old directory and the finished one as they were."""
    out = _ours(tmp_path / "ck")
    new = _ours(tmp_path / "new")
    (out / "added-meanwhile.txt").write_text("mine")
    before_out, before_new = _tree(out), _tree(new)
    with pytest.raises(BadInput, match="gained files .*added-meanwhile.txt.*nothing was replaced"):
        replace_dir(new, out, REPORT_NAME, CHECKPOINT_FILES, REPORT_KEYS)
    assert _tree(out) == before_out and _tree(new) == before_new
    (out / "added-meanwhile.txt").unlink()
    replace_dir(new, out, REPORT_NAME, CHECKPOINT_FILES, REPORT_KEYS)
    assert not new.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_statistics_directories_follow_the_same_rule(tmp_path):
    from infer_tool.calib.stats import check_stats_out

    out = tmp_path / "stats"
    out.mkdir()
    (out / "stats_index.json").write_text("not json")
    (out / "thesis.tex").write_text("mine")
    with pytest.raises(BadInput, match="thesis.tex"):
        check_stats_out(out, overwrite=True)
    (out / "thesis.tex").unlink()
    with pytest.raises(BadInput, match="not a document this tool wrote"):
        check_stats_out(out, overwrite=True)
    assert (out / "stats_index.json").read_text() == "not json"


def test_without_a_record_or_a_name_rule_nothing_is_ours(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "m.json").write_text("{}")
    with pytest.raises(BadInput, match=r"did not write \(m\.json\)"):
        check_out_dir(out, overwrite=True, marker="m.json")
    sign(out, "test", "m.json")
    check_out_dir(out, overwrite=True, marker="m.json")
