"""The built-in chat templates, one :class:`~trainer.templates.spec.Spec` per template.

Read an entry as a spec sheet: how each role's turn is written (``{content}`` is the message), what ends a
reply, which tool format renders tools and calls, whether it is a reasoning template. An entry that starts with
``**QWEN`` (or another family below) takes that family's layout and lists only what it adds; anything an entry
leaves out takes the default that :class:`~trainer.templates.spec.Spec` documents.

The names, the turn texts, the stop words and the default system prompts are those of LLaMA-Factory 0.9.5's
built-in templates, so that a model is trained on exactly the text it was trained on before and a
LLaMA-Factory config's ``template:`` means the same here. ``tests/golden/templates.json`` holds LLaMA-Factory's
own renderings of every entry; ``tests/trainer/test_templates_golden.py`` checks ferry against them.

Adding a template: append a ``Spec`` (the order is the order ``ferry train --templates`` lists), render a
conversation with :func:`trainer.templates.prompt_text` to read it back, and add the model family to
:data:`FAMILY_TEMPLATES` so that "did you mean" hints find it.
"""

from __future__ import annotations

from typing import Any

from trainer.templates.spec import BOS, EOS, Spec, Tok

# Turn texts that many templates share.
IM_SYSTEM = "<|im_start|>system\n{content}<|im_end|>\n"
IM_USER = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
IM_REPLY = "{content}<|im_end|>\n"
IM_TOOL_RESPONSE = "<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
IM_TOOL = "<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n"
GLM_USER = "<|user|>\n{content}<|assistant|>"
GLM_SYSTEM = "<|system|>\n{content}"
GLM_PREFIX = "[gMASK]<sop>"
GLM_OBSERVATION = "<|observation|>\n{content}<|assistant|>"
GLM_REPLY = "\n{content}"

# Layouts that whole families of templates share (an entry lists what it adds).
#: The gemma layout (gemma, gemma3, gemma3n).
GEMMA: dict[str, Any] = dict(
    prefix=(BOS,),
    system="{content}\n\n",
    user="<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",
    assistant="{content}<end_of_turn>\n",
    observation="<start_of_turn>tool\n{content}<end_of_turn>\n<start_of_turn>model\n",
    stop=("<end_of_turn>",),
    replace_eos=True,
    system_in_user=True,
)
#: The glm4 layout (glm4, glm_ocr, glmz1).
GLM4: dict[str, Any] = dict(
    prefix=GLM_PREFIX,
    system=GLM_SYSTEM,
    user=GLM_USER,
    assistant=GLM_REPLY,
    observation=GLM_OBSERVATION,
    call="{content}",
    tools="glm4",
    stop=("<|user|>", "<|observation|>"),
    efficient_eos=True,
)
#: The qwen layout (keye_vl, llava_next_qwen, mimo, mimo_vl, qwen, qwen3, qwen3_nothink, qwen2_omni, qwen3_omni,
#: qwen3_omni_nothink, qwen2_vl, qwen3_vl, qwen3_vl_nothink).
QWEN: dict[str, Any] = dict(
    system=IM_SYSTEM,
    user=IM_USER,
    assistant=IM_REPLY,
    observation=IM_TOOL_RESPONSE,
    tools="qwen",
    stop=("<|im_end|>",),
    replace_eos=True,
)
#: The llama3 layout (llama3, mllama, llava_next_llama3).
LLAMA3: dict[str, Any] = dict(
    prefix=(BOS,),
    system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
    user=(
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "{content}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    assistant="{content}<|eot_id|>",
    observation=(
        "<|start_header_id|>ipython<|end_header_id|>\n\n"
        "{content}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    tools="llama3",
    stop=("<|eot_id|>", "<|eom_id|>"),
    replace_eos=True,
)
#: The vicuna layout (llava, llava_next, llava_next_video, vicuna, video_llava).
VICUNA: dict[str, Any] = dict(
    user="USER: {content} ASSISTANT:",
)
#: The mistral layout (llava_next_mistral, llava_next_video_mistral, mistral).
MISTRAL: dict[str, Any] = dict(
    prefix=(BOS,),
    system="{content}\n\n",
    user="[INST] {content}[/INST]",
    assistant=(" {content}", EOS),
    observation='[TOOL_RESULTS] {"content": {content}}[/TOOL_RESULTS]',
    call=("[TOOL_CALLS] {content}", EOS),
    tools="mistral",
    system_in_user=True,
)
#: The yi layout (llava_next_yi, llava_next_video_yi, minicpm_v, minicpm_v_4_6, minicpm_o, smollm, smollm2, yi).
YI: dict[str, Any] = dict(
    system=IM_SYSTEM,
    user=IM_USER,
    assistant=IM_REPLY,
    stop=("<|im_end|>",),
)
#: The intern2 layout (intern2, intern_vl, intern_s1).
INTERN2: dict[str, Any] = dict(YI, prefix=(BOS,))
#: The ministral layout (ministral, ministral3, pixtral).
MINISTRAL: dict[str, Any] = dict(
    prefix=(BOS,),
    system="{content}\n\n",
    user="[INST]{content}[/INST]",
    observation='[TOOL_RESULTS]{"content": {content}}[/TOOL_RESULTS]',
    call=("[TOOL_CALLS]{content}", EOS),
    tools="mistral",
    system_in_user=True,
)
#: The qwen3_5 layout (qwen3_5, qwen3_5_nothink, qwen3_6).
QWEN3_5: dict[str, Any] = dict(QWEN, tools="qwen3_5")

#: Every built-in template, in LLaMA-Factory's registration order.
CATALOG: tuple[Spec, ...] = (
    Spec(
        "alpaca",
        user="### Instruction:\n{content}\n\n### Response:\n",
        assistant=("{content}", EOS, "\n\n"),
        default_system=(
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n"
            "\n"
        ),
    ),
    Spec(
        "bailing",
        system="<role>SYSTEM</role>{content}",
        user="<role>HUMAN</role>{content}<role>ASSISTANT</role>",
        observation="<role>OBSERVATION</role>{content}<role>ASSISTANT</role>",
        stop=("<|endoftext|>",),
        efficient_eos=True,
    ),
    Spec(
        "bailing_v2",
        system="<role>SYSTEM</role>{content}<|role_end|>",
        user="<role>HUMAN</role>{content}<|role_end|><role>ASSISTANT</role>",
        assistant="{content}<|role_end|>",
        observation=(
            "<role>OBSERVATION</role>\n<tool_response>\n{content}\n</tool_response><|role_end|><role>ASSISTANT</role>"
        ),
        tools="ling",
        stop=("<|endoftext|>",),
        efficient_eos=True,
    ),
    Spec(
        "breeze",
        prefix=(BOS,),
        user="[INST] {content} [/INST] ",
        efficient_eos=True,
    ),
    Spec(
        "chatglm3",
        prefix=(Tok("[gMASK]"), Tok("sop")),
        system=(Tok("<|system|>"), "\n", "{content}"),
        user=(Tok("<|user|>"), "\n", "{content}", Tok("<|assistant|>")),
        assistant=("\n", "{content}"),
        observation=(Tok("<|observation|>"), "\n", "{content}", Tok("<|assistant|>")),
        call="{content}",
        tools="glm4",
        stop=("<|user|>", "<|observation|>"),
        efficient_eos=True,
    ),
    Spec(
        "chatml",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        stop=("<|im_end|>", "<|im_start|>"),
        replace_eos=True,
    ),
    Spec(
        "chatml_de",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        default_system="Du bist ein freundlicher und hilfsbereiter KI-Assistent.",
        stop=("<|im_end|>", "<|im_start|>"),
        replace_eos=True,
    ),
    Spec(
        "cohere",
        prefix=(BOS,),
        system="<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        user=(
            "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{content}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|"
            ">"
        ),
    ),
    Spec(
        "cpm4",
        prefix=(BOS,),
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        stop=("<|im_end|>",),
    ),
    Spec(
        "dbrx",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        default_system=(
            "You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions based "
            "on information available up to that point.\n"
            "YOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR STATEMENTS, but provide thorough responses to more "
            "complex and open-ended questions.\n"
            "You assist with various tasks, from writing to coding (using markdown for code blocks — remember to use "
            "``` with code, JSON, and tables).\n"
            "(You do not have real-time data access or code execution capabilities. You avoid stereotyping and provide "
            "balanced perspectives on controversial topics. You do not provide song lyrics, poems, or news articles "
            "and do not divulge details of your training data.)\n"
            "This is your system prompt, guiding your responses. Do not reference it, just respond to the user. If you "
            "find yourself talking about this message, stop. You should be responding appropriately and usually that "
            "means not mentioning this.\n"
            "YOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS THE INFORMATION IS DIRECTLY PERTINENT TO "
            "THE USER'S QUERY."
        ),
        stop=("<|im_end|>",),
        replace_eos=True,
    ),
    Spec(
        "deepseek",
        prefix=(BOS,),
        system="{content}\n\n",
        user="User: {content}\n\nAssistant:",
    ),
    Spec(
        "deepseek3",
        prefix=(BOS,),
        user="<｜User｜>{content}<｜Assistant｜>",
    ),
    Spec(
        "deepseekr1",
        prefix=(BOS,),
        user="<｜User｜>{content}<｜Assistant｜>",
        thinking="block",
    ),
    Spec(
        "hy3",
        prefix=(BOS,),
        user="<｜hy_User｜>{content}<｜hy_Assistant｜>",
        assistant="{content}<｜hy_eos｜>",
        stop=("<｜hy_eos｜>",),
        replace_eos=True,
        thinking="block",
        think_tags=("<think>", "</think>"),
    ),
    Spec(
        "deepseekcoder",
        prefix=(BOS,),
        user="### Instruction:\n{content}\n### Response:",
        assistant="\n{content}\n<|EOT|>\n",
        default_system=(
            "You are an AI programming assistant, utilizing the DeepSeek Coder model, "
            "developed by DeepSeek Company, and you only answer questions related to computer "
            "science. For politically sensitive questions, security and privacy issues, and "
            "other non-computer science questions, you will refuse to answer.\n"
        ),
    ),
    Spec(
        "default",
        system=("System: {content}", EOS, "\n"),
        user=("Human: {content}", EOS, "\nAssistant:"),
        assistant=("{content}", EOS, "\n"),
    ),
    Spec(
        "dots_ocr",
        system="<|system|>{content}<|endofsystem|>\n",
        user="<|user|>{content}<|endofuser|><|assistant|>",
        assistant="{content}<|endofassistant|>",
        stop=("<|endofassistant|>",),
        efficient_eos=True,
        multimodal=True,
    ),
    Spec(
        "empty",
        assistant="{content}",
    ),
    Spec(
        "ernie",
        system="<|im_start|>system\n{content}<|im_end|>\n\n",
        user="<|im_start|>user\n{content}<|im_end|>\n\n<|im_start|>assistant\n",
        assistant="{content}<|im_end|>\n\n",
        observation="<|im_start|>tool\n{content}<|im_end|>\n\n<|im_start|>assistant\n",
        default_system="<global_setting>\nthink_mode=True\n</global_setting>",
        stop=("<|im_end|>",),
    ),
    Spec(
        "ernie_nothink",
        prefix="<|begin_of_sentence|>",
        system="{content}\n",
        user="User: {content}\nAssistant: ",
        assistant="{content}<|end_of_sentence|>",
        stop=("<|end_of_sentence|>",),
    ),
    Spec(
        "ernie_vl",
        system="{content}\n",
        user="User: {content}",
        assistant="\nAssistant: {content}<|end_of_sentence|>",
        stop=("<|end_of_sentence|>",),
        replace_eos=True,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "exaone",
        system="[|system|]{content}[|endofturn|]\n",
        user="[|user|]{content}\n[|assistant|]",
        assistant=("{content}", EOS, "\n"),
    ),
    Spec(
        "falcon",
        user="User: {content}\nFalcon:",
        assistant="{content}\n",
        efficient_eos=True,
    ),
    Spec(
        "falcon_h1",
        prefix=(BOS,),
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        stop=("<|im_end|>", "<|end_of_text|>"),
    ),
    Spec(
        "fewshot",
        assistant="{content}\n\n",
        efficient_eos=True,
    ),
    Spec(
        "gemma",
        **GEMMA,
    ),
    Spec(
        "gemma2",
        prefix=(BOS,),
        system="{content}\n\n",
        user="<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",
        assistant="{content}<end_of_turn>\n",
        observation="<start_of_turn>tool\n{content}<end_of_turn>\n<start_of_turn>model\n",
        stop=("<eos>", "<end_of_turn>"),
        efficient_eos=True,
        system_in_user=True,
    ),
    Spec(
        "gemma3",
        **GEMMA,
        multimodal=True,
    ),
    Spec(
        "gemma3n",
        **GEMMA,
        multimodal=True,
    ),
    Spec(
        "gemma4",
        prefix=(BOS,),
        system="<|turn>system\n<|think|>{content}<turn|>\n",
        user="<|turn>user\n{content}<turn|>\n<|turn>model\n",
        assistant="{content}<turn|>\n",
        observation="<|turn>tool\n{content}<turn|>\n<|turn>model\n",
        call="<|tool>{content}<tool|>",
        tools="gemma4",
        default_system="You are a helpful assistant.",
        stop=("<turn|>",),
        replace_eos=True,
        thinking="block",
        think_tags=("<|channel>thought\n", "<channel|>"),
        multimodal=True,
    ),
    Spec(
        "gemma4n",
        prefix=(BOS,),
        system="<|turn>system\n<|think|>{content}<turn|>\n",
        user="<|turn>user\n{content}<turn|>\n<|turn>model\n",
        assistant="{content}<turn|>\n",
        observation="<|turn>tool\n{content}<turn|>\n<|turn>model\n",
        call="<|tool>{content}<tool|>",
        tools="gemma4",
        default_system="You are a helpful assistant.",
        stop=("<turn|>",),
        replace_eos=True,
        thinking="block",
        think_tags=("<|channel>thought\n", "<channel|>"),
        multimodal=True,
    ),
    Spec(
        "glm4",
        **GLM4,
    ),
    Spec(
        "glm4_moe",
        prefix=GLM_PREFIX,
        system=GLM_SYSTEM,
        user=GLM_USER,
        assistant=GLM_REPLY,
        observation=GLM_OBSERVATION,
        call="{content}",
        tools="glm4_moe",
        stop=("<|user|>", "<|observation|>"),
        efficient_eos=True,
        thinking="block",
    ),
    Spec(
        "glm4v",
        prefix=GLM_PREFIX,
        system=GLM_SYSTEM,
        user=GLM_USER,
        assistant=GLM_REPLY,
        observation=GLM_OBSERVATION,
        call="{content}",
        tools="glm4",
        stop=("<|user|>", "<|observation|>", "</answer>"),
        efficient_eos=True,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "glm4_5v",
        prefix=GLM_PREFIX,
        system=GLM_SYSTEM,
        user=GLM_USER,
        assistant=GLM_REPLY,
        observation=GLM_OBSERVATION,
        call="{content}",
        tools="glm4_moe",
        stop=("<|user|>", "<|observation|>", "</answer>"),
        efficient_eos=True,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "glm_ocr",
        **GLM4,
        multimodal=True,
    ),
    Spec(
        "glm4_7",
        prefix=GLM_PREFIX,
        system=GLM_SYSTEM,
        user=GLM_USER,
        assistant=GLM_REPLY,
        observation=GLM_OBSERVATION,
        call="{content}",
        tools="glm4_moe",
        stop=("<|user|>", "<|observation|>"),
        efficient_eos=True,
        thinking="close",
        think_tags=("<think>", "</think>"),
    ),
    Spec(
        "glmz1",
        **GLM4,
        thinking="block",
    ),
    Spec(
        "gpt_oss",
        system="<|start|>system<|message|>{content}<|end|>",
        user="<|start|>user<|message|>{content}<|end|><|start|>assistant",
        default_system="You are ChatGPT, a large language model trained by OpenAI.",
        efficient_eos=True,
        thinking="block",
        think_tags=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
    ),
    Spec(
        "granite3",
        system="<|start_of_role|>system<|end_of_role|>{content}<|end_of_text|>\n",
        user=(
            "<|start_of_role|>user<|end_of_role|>{content}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
        ),
        assistant="{content}<|end_of_text|>\n",
    ),
    Spec(
        "granite3_vision",
        system="<|system|>\n{content}\n",
        user="<|user|>\n{content}\n<|assistant|>\n",
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
        multimodal=True,
    ),
    Spec(
        "granite4",
        system="<|start_of_role|>system<|end_of_role|>{content}<|end_of_text|>\n",
        user=(
            "<|start_of_role|>user<|end_of_role|>{content}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
        ),
        assistant="{content}<|end_of_text|>\n",
        observation=("<|start_of_role|>tool<|end_of_role|>{content}<|end_of_text|>\n<|start_of_role|>assistant\n"),
        default_system="You are Granite, developed by IBM. You are a helpful AI assistant.",
        stop=("<|end_of_text|>",),
    ),
    Spec(
        "index",
        system="<unk>{content}",
        user="reserved_0{content}reserved_1",
        efficient_eos=True,
    ),
    Spec(
        "hunyuan",
        prefix="<|startoftext|>",
        system="{content}<|extra_4|>",
        user="{content}<|extra_0|>",
        assistant="{content}<|eos|>",
        stop=("<|eos|>",),
    ),
    Spec(
        "hunyuan_small",
        prefix="<｜hy_begin▁of▁sentence｜>",
        system="{content}<｜hy_place▁holder▁no▁3｜>",
        user="<｜hy_User｜>{content}<｜hy_place▁holder▁no▁8｜>",
        assistant="{content}<｜hy_place▁holder▁no▁2｜>",
        stop=("<｜hy_place▁holder▁no▁2｜>",),
    ),
    Spec(
        "intern2",
        **INTERN2,
        default_system=(
            "You are an AI assistant whose name is InternLM (书生·浦语).\n"
            "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory "
            "(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
            "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user such as "
            "English and 中文."
        ),
    ),
    Spec(
        "intern_vl",
        **INTERN2,
        default_system="你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。",
        multimodal=True,
    ),
    Spec(
        "intern_s1",
        **INTERN2,
        multimodal=True,
    ),
    Spec(
        "keye_vl",
        **QWEN,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "kimi_vl",
        system="<|im_system|>system<|im_middle|>{content}<|im_end|>",
        user="<|im_user|>user<|im_middle|>{content}<|im_end|><|im_assistant|>assistant<|im_middle|>",
        assistant="{content}<|im_end|>",
        default_system="You are a helpful assistant",
        stop=("<|im_end|>",),
        thinking="block",
        think_tags=("◁think▷", "◁/think▷"),
        multimodal=True,
    ),
    Spec(
        "lfm2",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=(
            "<|im_start|>tool\n<|tool_response_start|>{content}<|tool_response_end|><|im_end|>\n<|im_start|>assistant\n"
        ),
        tools="lfm2",
        default_system="You are a helpful AI assistant.",
        stop=("<|im_end|>",),
        replace_eos=True,
        call_tags=("<|tool_call_start|>", "<|tool_call_end|>"),
    ),
    Spec(
        "lfm2_vl",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=(
            "<|im_start|>tool\n<|tool_response_start|>{content}<|tool_response_end|><|im_end|>\n<|im_start|>assistant\n"
        ),
        tools="lfm2",
        default_system="You are a helpful multimodal assistant by Liquid AI.",
        stop=("<|im_end|>",),
        replace_eos=True,
        call_tags=("<|tool_call_start|>", "<|tool_call_end|>"),
        multimodal=True,
    ),
    Spec(
        "llama2",
        system="<<SYS>>\n{content}\n<</SYS>>\n\n",
        user=(BOS, "[INST] {content} [/INST]"),
        system_in_user=True,
    ),
    Spec(
        "llama2_zh",
        system="<<SYS>>\n{content}\n<</SYS>>\n\n",
        user=(BOS, "[INST] {content} [/INST]"),
        default_system="You are a helpful assistant. 你是一个乐于助人的助手。",
        system_in_user=True,
    ),
    Spec(
        "llama3",
        **LLAMA3,
    ),
    Spec(
        "llama4",
        prefix=(BOS,),
        system="<|header_start|>system<|header_end|>\n\n{content}<|eot|>",
        user=("<|header_start|>user<|header_end|>\n\n{content}<|eot|><|header_start|>assistant<|header_end|>\n\n"),
        assistant="{content}<|eot|>",
        observation=(
            "<|header_start|>ipython<|header_end|>\n\n{content}<|eot|><|header_start|>assistant<|header_end|>\n\n"
        ),
        tools="llama3",
        stop=("<|eot|>", "<|eom|>"),
        replace_eos=True,
        multimodal=True,
    ),
    Spec(
        "mllama",
        **LLAMA3,
        multimodal=True,
    ),
    Spec(
        "moonlight",
        system="<|im_system|>system<|im_middle|>{content}<|im_end|>",
        user="<|im_user|>user<|im_middle|>{content}<|im_end|><|im_assistant|>assistant<|im_middle|>",
        assistant="{content}<|im_end|>",
        default_system="You are a helpful assistant provided by Moonshot-AI.",
        stop=("<|im_end|>",),
        replace_eos=True,
    ),
    Spec(
        "llava",
        **VICUNA,
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
        multimodal=True,
    ),
    Spec(
        "llava_next",
        **VICUNA,
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
        multimodal=True,
    ),
    Spec(
        "llava_next_llama3",
        **LLAMA3,
        multimodal=True,
    ),
    Spec(
        "llava_next_mistral",
        **MISTRAL,
        multimodal=True,
    ),
    Spec(
        "llava_next_qwen",
        **QWEN,
        default_system="You are a helpful assistant.",
        multimodal=True,
    ),
    Spec(
        "llava_next_yi",
        **YI,
        multimodal=True,
    ),
    Spec(
        "llava_next_video",
        **VICUNA,
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
        multimodal=True,
    ),
    Spec(
        "llava_next_video_mistral",
        **MISTRAL,
        multimodal=True,
    ),
    Spec(
        "llava_next_video_yi",
        **YI,
        multimodal=True,
    ),
    Spec(
        "mimo",
        **QWEN,
        default_system="You are a helpful assistant.",
        thinking="block",
    ),
    Spec(
        "mimo_v2",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL_RESPONSE,
        tools="qwen",
        default_system="You are MiMo, a helpful AI assistant engineered by Xiaomi.",
        stop=("<|im_end|>",),
        replace_eos=True,
        thinking="block",
        think_tags=("<think>", "</think>"),
    ),
    Spec(
        "mimo_vl",
        **QWEN,
        default_system="You are MiMo, an AI assistant developed by Xiaomi.",
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "minicpm_v",
        **YI,
        default_system="You are a helpful assistant.",
        multimodal=True,
    ),
    Spec(
        "minicpm_v_4_6",
        **YI,
        default_system="You are a helpful assistant.",
        multimodal=True,
    ),
    Spec(
        "minicpm_o",
        **YI,
        default_system=("You are a helpful assistant. You can accept audio and text input and output voice and text."),
        multimodal=True,
    ),
    Spec(
        "minimax1",
        system="<beginning_of_sentence>system ai_setting=assistant\n{content}<end_of_sentence>\n",
        user=(
            "<beginning_of_sentence>user name=user\n{content}<end_of_sentence>\n"
            "<beginning_of_sentence>ai name=assistant\n"
        ),
        assistant="{content}<end_of_sentence>\n",
        observation=(
            "<beginning_of_sentence>tool name=tools\n{content}<end_of_sentence>\n"
            "<beginning_of_sentence>ai name=assistant\n"
        ),
        tools="minimax1",
        default_system="You are a helpful assistant.",
        stop=("<end_of_sentence>",),
    ),
    Spec(
        "minimax2",
        system="]~!b[]~b]system\n{content}[e~[\n",
        user="]~b]user\n{content}[e~[\n]~b]ai\n",
        assistant="{content}[e~[\n",
        observation="]~b]tool\n<response>{content}</response>[e~[\n]~b]ai\n",
        tools="minimax2",
        default_system="You are a helpful assistant. Your name is MiniMax-M2.1 and is built by MiniMax.",
        stop=("[e~[",),
        thinking="block",
    ),
    Spec(
        "ministral",
        **MINISTRAL,
    ),
    Spec(
        "mistral",
        **MISTRAL,
    ),
    Spec(
        "mistral_small",
        prefix=(BOS,),
        system="[SYSTEM_PROMPT]{content}[/SYSTEM_PROMPT]",
        user="[INST]{content}[/INST]",
        observation='[TOOL_RESULTS]{"content": {content}}[/TOOL_RESULTS]',
        call=("[TOOL_CALLS]{content}", EOS),
        tools="mistral",
        multimodal=True,
    ),
    Spec(
        "ministral3",
        **MINISTRAL,
        multimodal=True,
    ),
    Spec(
        "olmo",
        prefix=(EOS,),
        user="<|user|>\n{content}<|assistant|>\n",
    ),
    Spec(
        "openchat",
        prefix=(BOS,),
        user=("GPT4 Correct User: {content}", EOS, "GPT4 Correct Assistant:"),
    ),
    Spec(
        "openchat-3.6",
        prefix=(BOS,),
        user=(
            "<|start_header_id|>GPT4 Correct User<|end_header_id|>\n\n"
            "{content}<|eot_id|><|start_header_id|>GPT4 Correct Assistant<|end_header_id|>\n\n"
        ),
        stop=("<|eot_id|>",),
    ),
    Spec(
        "opencoder",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        observation=IM_TOOL,
        default_system="You are OpenCoder, created by OpenCoder Team.",
        stop=("<|im_end|>",),
    ),
    Spec(
        "paligemma",
        prefix=(BOS,),
        user="{content}\n",
        system_in_user=True,
        multimodal=True,
    ),
    Spec(
        "paligemma_chat",
        prefix=(BOS,),
        user="<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",
        assistant="{content}<end_of_turn>\n",
        observation="<start_of_turn>tool\n{content}<end_of_turn>\n<start_of_turn>model\n",
        stop=("<end_of_turn>",),
        replace_eos=True,
        system_in_user=True,
        multimodal=True,
    ),
    Spec(
        "phi",
        system="<|system|>\n{content}<|end|>\n",
        user="<|user|>\n{content}<|end|>\n<|assistant|>\n",
        assistant="{content}<|end|>\n",
        stop=("<|end|>",),
        replace_eos=True,
    ),
    # LLaMA-Factory registers phi_small with a prefix piece that its renderer writes as nothing (a token set that
    # is neither BOS nor EOS); the goldens agree, so there is no prefix here.
    Spec(
        "phi_small",
        system="<|system|>\n{content}<|end|>\n",
        user="<|user|>\n{content}<|end|>\n<|assistant|>\n",
        assistant="{content}<|end|>\n",
        stop=("<|end|>",),
        replace_eos=True,
    ),
    Spec(
        "phi4",
        system="<|im_start|>system<|im_sep|>{content}<|im_end|>",
        user="<|im_start|>user<|im_sep|>{content}<|im_end|><|im_start|>assistant<|im_sep|>",
        assistant="{content}<|im_end|>",
        stop=("<|im_end|>",),
        replace_eos=True,
    ),
    Spec(
        "phi4_mini",
        system="<|system|>{content}<|end|>",
        user="<|user|>{content}<|end|><|assistant|>",
        assistant="{content}<|end|>",
        raw_tools="<|tool|>{content}<|/tool|>",
        stop=("<|end|>",),
        replace_eos=True,
    ),
    Spec(
        "pixtral",
        **MINISTRAL,
        multimodal=True,
    ),
    Spec(
        "qwen",
        **QWEN,
        default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    ),
    Spec(
        "qwen3",
        **QWEN,
        thinking="block",
    ),
    Spec(
        "qwen3_nothink",
        **QWEN,
    ),
    Spec(
        "qwen2_audio",
        system=IM_SYSTEM,
        user=IM_USER,
        assistant=IM_REPLY,
        default_system="You are a helpful assistant.",
        stop=("<|im_end|>",),
        replace_eos=True,
        multimodal=True,
    ),
    Spec(
        "qwen2_omni",
        **QWEN,
        default_system="You are a helpful assistant.",
        multimodal=True,
    ),
    Spec(
        "qwen3_omni",
        **QWEN,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "qwen3_omni_nothink",
        **QWEN,
        multimodal=True,
    ),
    Spec(
        "qwen2_vl",
        **QWEN,
        default_system="You are a helpful assistant.",
        multimodal=True,
    ),
    Spec(
        "qwen3_vl",
        **QWEN,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "qwen3_vl_nothink",
        **QWEN,
        multimodal=True,
    ),
    Spec(
        "qwen3_5",
        **QWEN3_5,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "qwen3_5_nothink",
        **QWEN3_5,
        multimodal=True,
    ),
    Spec(
        "qwen3_6",
        **QWEN3_5,
        thinking="block",
        multimodal=True,
    ),
    Spec(
        "sailor",
        system=IM_SYSTEM,
        user="<|im_start|>question\n{content}<|im_end|>\n<|im_start|>answer\n",
        assistant=IM_REPLY,
        default_system=(
            "You are an AI assistant named Sailor created by Sea AI Lab. Your answer should "
            "be friendly, unbiased, faithful, informative and detailed."
        ),
        stop=("<|im_end|>",),
    ),
    Spec(
        "seed_coder",
        system=(BOS, "system\n{content}", EOS),
        user=(BOS, "user\n{content}", EOS, BOS, "assistant\n"),
        default_system=(
            "You are an AI programming assistant, utilizing the Seed-Coder model, developed by ByteDance Seed, and you "
            "only answer questions related to computer science. For politically sensitive questions, security and "
            "privacy issues, and other non-computer science questions, you will refuse to answer.\n"
            "\n"
        ),
    ),
    Spec(
        "seed_oss",
        system=(BOS, "system\n{content}", EOS),
        user=(BOS, "user\n{content}", EOS, BOS, "assistant\n"),
        call=(BOS, "\n{content}", EOS),
        tools="seed_oss",
        thinking="block",
        think_tags=("<seed:think>", "</seed:think>"),
    ),
    Spec(
        "smollm",
        **YI,
    ),
    Spec(
        "smollm2",
        **YI,
        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    ),
    Spec(
        "solar",
        system="### System:\n{content}\n\n",
        user="### User:\n{content}\n\n### Assistant:\n",
        efficient_eos=True,
    ),
    Spec(
        "starchat",
        system="<|system|>\n{content}<|end|>\n",
        user="<|user|>\n{content}<|end|>\n<|assistant|>",
        assistant="{content}<|end|>\n",
        stop=("<|end|>",),
    ),
    Spec(
        "telechat2",
        system="<_system>{content}",
        user="<_user>{content}<_bot>",
        default_system="你是中国电信星辰语义大模型，英文名是TeleChat，你是由中电信人工智能科技有限公司和中国电信人工智能研究院（TeleAI）研发的人工智能助手。",
    ),
    Spec(
        "vicuna",
        **VICUNA,
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
    ),
    Spec(
        "video_llava",
        **VICUNA,
        default_system=(
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions."
        ),
        multimodal=True,
    ),
    Spec(
        "xuanyuan",
        user="Human: {content} Assistant:",
        default_system=(
            "以下是用户和人工智能助手之间的对话。用户以Human开头，人工智能助手以Assistant开头，会对人类提出的问题给出有帮助、高质量、详细和礼貌的回答，并且总是拒绝参与与不道德、不安全、有争议、政治敏感等相关的话"
            "题、问题和指示。\n"
        ),
    ),
    Spec(
        "yi",
        **YI,
    ),
    Spec(
        "yi_vl",
        user="### Human: {content}\n### Assistant:",
        assistant="{content}\n",
        default_system=(
            "This is a chat between an inquisitive human and an AI assistant. Assume the role of the AI assistant. "
            "Read all the images carefully, and respond to the human's questions with informative, helpful, detailed "
            "and polite answers. 这是一个好奇的人类和一个人工智能助手之间的对话。假设你扮演这个AI助手的角色。"
            "仔细阅读所有的图像，并对人类的问题做出信息丰富、有帮助、详细的和礼貌的回答。\n"
            "\n"
        ),
        stop=("###",),
        efficient_eos=True,
        multimodal=True,
    ),
    Spec(
        "youtu",
        prefix=(BOS,),
        user="<|User|>{content}<|Assistant|>",
        assistant="{content}<|end_of_text|>",
        observation="<tool_response>\n{content}\n</tool_response><|Assistant|>",
        call="{content}",
        stop=("<|end_of_text|>",),
        replace_eos=True,
        thinking="block",
    ),
    Spec(
        "youtu_vl",
        system="<|begin_of_text|>system\n{content}<|end_of_text|>\n",
        user="<|begin_of_text|>user\n{content}<|end_of_text|>\n<|begin_of_text|>assistant\n",
        assistant="{content}<|end_of_text|>\n",
        default_system="You are a helpful assistant.",
        stop=("<|end_of_text|>",),
        multimodal=True,
    ),
    Spec(
        "yuan",
        user=("{content}", Tok("<sep>")),
        assistant="{content}<eod>\n",
        stop=("<eod>",),
    ),
    Spec(
        "zephyr",
        system=("<|system|>\n{content}", EOS),
        user=("<|user|>\n{content}", EOS, "<|assistant|>\n"),
        default_system="You are Zephyr, a helpful assistant.",
    ),
    Spec(
        "aeva",
        prefix=GLM_PREFIX,
        system=GLM_SYSTEM,
        user=GLM_USER,
        assistant=GLM_REPLY,
        observation=GLM_OBSERVATION,
        call="{content}",
        tools="glm4_moe",
        default_system=(
            "You are an AI assistant named Aeva created by Zongzhi Lou. Your answer should be "
            "friendly, unbiased, faithful, informative and detailed."
        ),
        stop=("<|user|>", "<|observation|>"),
        efficient_eos=True,
        thinking="close",
        think_tags=("<think>", "</think>"),
    ),
)

#: Built-in templates that fit a base model, by the ``model_type`` of its config.json (LLaMA-Factory's
#: ``extras/constants.py`` model groups, reduced to the template names). Used for "did you mean" hints.
FAMILY_TEMPLATES: dict[str, tuple[str, ...]] = {
    "qwen3": ("qwen3", "qwen3_nothink"),
    "qwen3_moe": ("qwen3", "qwen3_nothink"),
    "qwen3_next": ("qwen3", "qwen3_nothink"),
    "qwen3_5": ("qwen3_5", "qwen3_5_nothink"),
    "qwen3_5_moe": ("qwen3_5", "qwen3_5_nothink"),
    "qwen3_5_text": ("qwen3_5", "qwen3_5_nothink"),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_nothink"),
    "qwen3_vl_moe": ("qwen3_vl", "qwen3_vl_nothink"),
    "qwen2": ("qwen",),
    "qwen2_moe": ("qwen",),
    "qwen": ("qwen",),
    "qwen2_vl": ("qwen2_vl",),
    "qwen2_5_vl": ("qwen2_vl",),
    "llama": ("llama3", "llama2"),
    "llama4": ("llama4",),
    "mllama": ("mllama",),
    "mistral": ("mistral", "ministral"),
    "mixtral": ("mistral",),
    "ministral": ("ministral",),
    "gemma": ("gemma",),
    "gemma2": ("gemma2",),
    "gemma3": ("gemma3",),
    "gemma3_text": ("gemma3",),
    "gemma3n": ("gemma3n",),
    "glm4": ("glm4",),
    "glm": ("glm4",),
    "glm4_moe": ("glm4_moe",),
    "chatglm": ("chatglm3",),
    "deepseek_v2": ("deepseek",),
    "deepseek_v3": ("deepseek3", "deepseekr1"),
    "yi": ("yi",),
    "baichuan": ("baichuan2",),
    "internlm2": ("intern2",),
    "phi": ("phi",),
    "phi3": ("phi", "phi4"),
    "cohere": ("cohere",),
    "cohere2": ("cohere",),
    "falcon": ("falcon",),
    "falcon_h1": ("falcon_h1",),
    "gpt_oss": ("gpt_oss",),
    "olmo": ("olmo",),
    "olmo2": ("olmo",),
    "granite": ("granite3",),
    "granitemoe": ("granite3",),
    "seed_oss": ("seed_oss",),
    "hunyuan_v1_dense": ("hunyuan",),
    "hunyuan_v1_moe": ("hunyuan",),
    "telechat": ("telechat2",),
    "exaone": ("exaone",),
    "minimax": ("minimax1",),
    "smollm3": ("smollm2",),
}
