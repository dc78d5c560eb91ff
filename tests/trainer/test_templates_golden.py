"""ferry's built-in templates against LLaMA-Factory 0.9.5's own renderings (tests/golden/templates.json, made by
tests/golden/make_template_goldens.py): the same tokens, trained or not, for every template, conversation,
data-argument variant (mask_history, cutoff_len, train_on_prompt, enable_thinking, default_system, tool_format)
and tokenizer profile; the same refusals."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))

from conversations import CONVERSATIONS, OPTIONS, PINNED_DATE, REQUIRED_TEMPLATES  # noqa: E402
from standin import PROFILES, StandInTokenizer, runs  # noqa: E402

DOC = json.loads((GOLDEN / "templates.json").read_text(encoding="utf-8"))


def _render(case: dict) -> tuple[list, str, list]:
    from trainer.data import build_example, encode_pairs_builtin
    from trainer.formats import Sample
    from trainer.templates import get_template

    opts = {
        "cutoff_len": 2048,
        "mask_history": False,
        "train_on_prompt": False,
        "enable_thinking": True,
        "default_system": None,
        "tool_format": None,
        **OPTIONS[case["option"]][1],
    }
    conv = CONVERSATIONS[case["conversation"]]
    bos, eos = PROFILES[case["profile"]]
    tokenizer = StandInTokenizer(bos, eos)
    template = get_template(
        case["template"],
        default_system=opts["default_system"],
        enable_thinking=opts["enable_thinking"],
        tool_format=opts["tool_format"],
        train_on_prompt=opts["train_on_prompt"],
    )
    template.fix_special_tokens(tokenizer)
    sample = Sample(
        turns=[(m["role"], m["content"]) for m in conv["messages"]], system=conv["system"], tools=conv["tools"]
    )
    pairs = encode_pairs_builtin(sample, template, tokenizer, mask_history=opts["mask_history"])
    ids, labels, _ = build_example(
        pairs,
        opts["cutoff_len"],
        train_on_prompt=opts["train_on_prompt"],
        mask_history=opts["mask_history"],
        efficient_eos_id=tokenizer.eos_token_id if template.efficient_eos else None,
    )
    return runs(ids, labels), tokenizer.eos_token, tokenizer.additional_special_tokens


@pytest.fixture(autouse=True)
def _pinned_date(monkeypatch):
    import trainer.templates.tools as tools

    monkeypatch.setattr(tools, "today", lambda: datetime.datetime(*PINNED_DATE))


def test_goldens_cover_the_required_templates_and_every_builtin() -> None:
    from trainer.templates import TEMPLATES

    assert DOC["llamafactory"] == "0.9.5"
    assert set(REQUIRED_TEMPLATES) <= set(DOC["templates"])
    assert list(TEMPLATES) == DOC["templates"]  # the same names, in LLaMA-Factory's order
    covered = {c["template"] for c in DOC["cases"] if "runs" in c}
    assert covered == set(DOC["templates"])


@pytest.mark.parametrize("name", DOC["templates"])
def test_template_matches_llamafactory(name: str) -> None:
    cases = [c for c in DOC["cases"] if c["template"] == name]
    assert cases
    for case in cases:
        where = f"{name} / {case['conversation']} / {case['option']} / {case['profile']}"
        if "error" in case:
            with pytest.raises((ValueError, RuntimeError)):
                _render(case)
            continue
        got_runs, eos, specials = _render(case)
        assert got_runs == case["runs"], where
        assert (eos, specials) == (case["eos_token"], case["special_tokens"]), where


def test_golden_examples_from_the_issue() -> None:
    """Differences once reported against LLaMA-Factory, now rendered as LLaMA-Factory renders them."""
    by_key = {(c["template"], c["conversation"], c["option"], c["profile"]): c for c in DOC["cases"]}
    default = by_key[("default", "single_system", "plain", "llama2")]["runs"]
    assert default == [["System: S</s>\nHuman: Hi</s>\nAssistant:", False], ["Ahoy!</s>\n", True]]
    qwen = by_key[("qwen", "single", "plain", "llama2")]
    assert qwen["eos_token"] == "<|im_end|>"
    assert qwen["runs"][-1] == ["Ahoy!<|im_end|>\n", True]
    assert "You are Qwen" not in qwen["runs"][0][0] or "Alibaba" in qwen["runs"][0][0]
    tools = by_key[("qwen", "tools", "plain", "qwen")]["runs"]
    text = "".join(t for t, _ in tools)
    assert "# Tools" in text and "<tools>" in text and "<tool_call>" in text and "<tool_response>" in text


def test_ferry_train_templates_lists_every_builtin() -> None:
    from click.testing import CliRunner

    from ferry.cli.train import train_command

    result = CliRunner().invoke(train_command, ["--templates"])
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.output.splitlines() if line.strip()]
    assert names == DOC["templates"]
    qwen = next(line for line in result.output.splitlines() if line.startswith("qwen "))
    assert "EOS=<|im_end|>" in qwen and "default system" in qwen
    assert "reasoning" in next(line for line in result.output.splitlines() if line.startswith("qwen3 "))


REAL_DOC = json.loads((GOLDEN / "templates_real_tokenizer.json").read_text(encoding="utf-8"))


def test_templates_match_llamafactory_on_a_real_tokenizer(stories_model) -> None:
    """The same ids and labels as LLaMA-Factory with the real stories260K tokenizer (BPE: where a template cuts
    its text into separately tokenised pieces shows in the ids), for every template and the real-tokenizer
    goldens' variants (tests/golden/make_real_tokenizer_goldens.py); the same refusals."""
    import copy

    from make_real_tokenizer_goldens import digest
    from transformers import AutoTokenizer

    from trainer.data import build_example, encode_pairs_builtin
    from trainer.formats import Sample
    from trainer.templates import get_template

    assert REAL_DOC["llamafactory"] == "0.9.5" and len(REAL_DOC["cases"]) > 2000
    base = AutoTokenizer.from_pretrained(str(stories_model))
    mismatches = []
    for case in REAL_DOC["cases"]:
        opts = {
            "mask_history": False,
            "enable_thinking": True,
            "default_system": None,
            "tool_format": None,
            **OPTIONS[case["option"]][1],
        }
        conv = CONVERSATIONS[case["conversation"]]
        tokenizer = copy.deepcopy(base)
        try:
            template = get_template(
                case["template"],
                default_system=opts["default_system"],
                enable_thinking=opts["enable_thinking"],
                tool_format=opts["tool_format"],
            )
            template.fix_special_tokens(tokenizer)
            sample = Sample(
                turns=[(m["role"], m["content"]) for m in conv["messages"]], system=conv["system"], tools=conv["tools"]
            )
            pairs = encode_pairs_builtin(sample, template, tokenizer, mask_history=opts["mask_history"])
            ids, labels, _ = build_example(
                pairs,
                2048,
                mask_history=opts["mask_history"],
                efficient_eos_id=tokenizer.eos_token_id if template.efficient_eos else None,
            )
            got = digest(ids, labels)
        except (ValueError, RuntimeError, KeyError):
            got = "refused"
        want = "refused" if "error" in case else case["sha256"]
        if got != want:
            mismatches.append(f"{case['template']} / {case['conversation']} / {case['option']}")
    assert not mismatches, mismatches[:20]
