"""Render the golden conversations with LLaMA-Factory's own template code: tests/golden/templates.json.

Run in a separate venv holding LLaMA-Factory 0.9.5 (it needs an older transformers than ferry)::

    python3 -m venv /tmp/lf-venv
    /tmp/lf-venv/bin/pip install -c constraints.txt llamafactory==0.9.5
    /tmp/lf-venv/bin/pip uninstall -y torchvision torchaudio   # their wheels do not load with the local torch
    /tmp/lf-venv/bin/python tests/golden/make_template_goldens.py

For every built-in template, conversation (``conversations.CONVERSATIONS``), data-argument variant
(``conversations.OPTIONS``) and tokenizer profile (``standin.PROFILES``) it runs LLaMA-Factory's
``get_template_and_fix_tokenizer`` and ``SupervisedDatasetProcessor._encode_data_example`` (the exact code path
of ``stage: sft``) with the stand-in tokenizer of ``standin.py``, and records the tokens as runs of text marked
trainable or not. A case LLaMA-Factory refuses is recorded with its error class. The llama3 tool prompt's date
is pinned to ``conversations.PINNED_DATE``. Multimodal templates run with LLaMA-Factory's base (text-only)
plugin: without images their plugins change no text but need the model's processor. ferry's tests compare against the
JSON, so the test suite never
needs LLaMA-Factory.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conversations import CONVERSATIONS, OPTIONS, PINNED_DATE, REQUIRED_TEMPLATES  # noqa: E402
from standin import PROFILES, StandInTokenizer, runs  # noqa: E402


def llamafactory_api() -> SimpleNamespace:
    """LLaMA-Factory's template registry and supervised processor, imported for rendering goldens: its llama3
    tool prompt's date pinned to ``PINNED_DATE``; ``text_only`` is its base (text) multimodal plugin.
    LLaMA-Factory imports torchaudio on some paths and that wheel does not load with the local torch: an empty
    torchaudio module on sys.path stands in (the template code never uses it)."""
    stub = Path(tempfile.mkdtemp(prefix="lf-stub-"))
    (stub / "torchaudio.py").write_text("")
    sys.path.insert(0, str(stub))
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    import llamafactory.data.template as lf_template
    import llamafactory.data.tool_utils as lf_tools
    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    class _PinnedDate(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*PINNED_DATE)

    lf_tools.datetime = _PinnedDate
    return SimpleNamespace(
        template=lf_template,
        processor=SupervisedDatasetProcessor,
        data_args=DataArguments,
        text_only=get_mm_plugin(name="base"),
    )


def main(out: Path = HERE / "templates.json") -> None:
    import copy
    from importlib.metadata import version

    lf = llamafactory_api()
    lf_template, SupervisedDatasetProcessor, DataArguments = lf.template, lf.processor, lf.data_args
    pristine = copy.deepcopy(lf_template.TEMPLATES)
    text_only = lf.text_only
    cases = []
    for name in pristine:
        options = OPTIONS if name in REQUIRED_TEMPLATES else {"plain": OPTIONS["plain"]}
        profiles = PROFILES if name in REQUIRED_TEMPLATES else dict(list(PROFILES.items())[:1])
        for option, (conv_names, overrides) in options.items():
            for conv_name in conv_names:
                conv = CONVERSATIONS[conv_name]
                for profile, (bos, eos) in profiles.items():
                    lf_template.TEMPLATES[name] = copy.deepcopy(pristine[name])  # get_template mutates it
                    # Text-only data: a multimodal template's plugin changes nothing without images, but needs
                    # the model's processor to run; the base plugin renders the same text without it.
                    lf_template.TEMPLATES[name].mm_plugin = text_only
                    case = {"template": name, "conversation": conv_name, "option": option, "profile": profile}
                    tokenizer = StandInTokenizer(bos, eos)
                    try:
                        data_args = DataArguments(template=name, **{"cutoff_len": 2048, **overrides})
                        template = lf_template.get_template_and_fix_tokenizer(tokenizer, data_args)
                        processor = SupervisedDatasetProcessor(
                            template=template, tokenizer=tokenizer, processor=None, data_args=data_args
                        )
                        messages = copy.deepcopy(conv["messages"])
                        input_ids, labels = processor._encode_data_example(
                            prompt=messages[:-1],
                            response=messages[-1:],
                            system=conv["system"],
                            tools=conv["tools"],
                            images=[],
                            videos=[],
                            audios=[],
                        )
                        case["runs"] = runs(input_ids, labels)
                        case["eos_token"] = tokenizer.eos_token
                        case["special_tokens"] = tokenizer.additional_special_tokens
                    except Exception as exc:  # a refusal is part of the golden
                        case["error"] = type(exc).__name__
                        case["message"] = str(exc)[:200]
                    cases.append(case)
    doc = {
        "generator": "tests/golden/make_template_goldens.py",
        "llamafactory": version("llamafactory"),
        "pinned_date": list(PINNED_DATE),
        "templates": list(pristine),
        "cases": cases,
    }
    tmp = out.with_suffix(".tmp")
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"}, ensure_ascii=False)[:-1]
    lines = [json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases]
    tmp.write_text(head + ',\n"cases":[\n' + ",\n".join(lines) + "\n]}\n", encoding="utf-8")
    tmp.replace(out)
    print(f"{len(cases)} cases from {len(pristine)} templates -> {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
