"""Render the golden conversations with LLaMA-Factory's own template code and a REAL tokenizer (the stories260K
Llama tokenizer in ../shared/assets): tests/golden/templates_real_tokenizer.json.

``templates.json`` reads renderings back as text through a stand-in tokenizer; this file pins the token ids a
real BPE tokenizer gives, where the way a template cuts its text into separately tokenised pieces shows. Each
case records the SHA-256 of LLaMA-Factory's ``[input_ids, labels]`` (JSON, no spaces), or the error class of a
refusal. Run it as ``make_template_goldens.py`` is run (in a venv holding LLaMA-Factory 0.9.5)::

    /tmp/lf-venv/bin/python tests/golden/make_real_tokenizer_goldens.py
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STORIES = HERE.parents[1].parent / "shared" / "assets" / "models" / "stories260K"
sys.path.insert(0, str(HERE))

from conversations import CONVERSATIONS, OPTIONS, PINNED_DATE  # noqa: E402

#: The data-argument variants rendered with the real tokenizer.
REAL_OPTIONS = ("plain", "no_thinking", "mask_history", "tool_format_qwen")


def digest(input_ids: list[int], labels: list[int]) -> str:
    """The SHA-256 recorded for one rendering."""
    return hashlib.sha256(json.dumps([input_ids, labels], separators=(",", ":")).encode()).hexdigest()


def main(out: Path = HERE / "templates_real_tokenizer.json") -> None:
    from importlib.metadata import version

    from make_template_goldens import llamafactory_api
    from transformers import AutoTokenizer

    lf = llamafactory_api()
    lf_template, SupervisedDatasetProcessor, DataArguments = lf.template, lf.processor, lf.data_args
    pristine = copy.deepcopy(lf_template.TEMPLATES)
    text_only = lf.text_only
    base_tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    cases = []
    for name in pristine:
        for option in REAL_OPTIONS:
            conv_names, overrides = OPTIONS[option]
            for conv_name in conv_names:
                conv = CONVERSATIONS[conv_name]
                lf_template.TEMPLATES[name] = copy.deepcopy(pristine[name])
                lf_template.TEMPLATES[name].mm_plugin = text_only
                tokenizer = copy.deepcopy(base_tokenizer)
                case = {"template": name, "conversation": conv_name, "option": option}
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
                    case["sha256"] = digest(input_ids, labels)
                except Exception as exc:  # a refusal is part of the golden
                    case["error"] = type(exc).__name__
                cases.append(case)
    doc = {
        "generator": "tests/golden/make_real_tokenizer_goldens.py",
        "llamafactory": version("llamafactory"),
        "transformers": version("transformers"),
        "tokenizer": "stories260K",
        "pinned_date": list(PINNED_DATE),
        "cases": cases,
    }
    tmp = out.with_suffix(".tmp")
    lines = [json.dumps(c, separators=(",", ":")) for c in cases]
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"})[:-1]
    tmp.write_text(head + ',\n"cases":[\n' + ",\n".join(lines) + "\n]}\n", encoding="utf-8")
    tmp.replace(out)
    print(f"{len(cases)} cases -> {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
