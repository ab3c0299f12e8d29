"""What the GPT-OSS presets' tokenizer has that the others' lack: the harmony format's special
tokens, at the end of the vocabulary as GPT-OSS's o200k_harmony has them (reserved tokens fill any
gap the trained merges leave), and a harmony chat template written here in Jinja, as GPT-OSS's
checkpoint ships one (jaxrunner/server/harmony.py parses the output it asks for).

The template renders OpenAI's harmony format:
- a system message: the model identity, `Reasoning: low|medium|high` (`reasoning_effort`,
  default medium) and the valid channels (with the line routing function calls to `commentary`
  when there are tools);
- a developer message, when there are system/developer messages or tools: `# Instructions` and
  the tools as a TypeScript-like `namespace functions { type f = (_: {...}) => any; }`;
- user turns; an assistant's earlier answers in `final` (their reasoning dropped, as the format
  asks), its tool calls as `<|channel|>commentary to=functions.NAME <|constrain|>json` ending in
  `<|call|>` (with the turn's `analysis` before them, `thinking` or `reasoning_content`);
  tool results as `<|start|>functions.NAME to=assistant<|channel|>commentary`;
- the generation prompt `<|start|>assistant`.
"""

from typing import Any

# In GPT-OSS's order; the last id of the vocabulary is <|call|>'s.
HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                  "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
BOS, PAD, EOS = "<|startoftext|>", "<|endoftext|>", "<|return|>"
# Generation ends at the end of an answer or of a tool call (or the document), as GPT-OSS's
# generation_config.json says.
STOP_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")


def token_ids(vocab_size: int) -> dict[str, int]:
    """The harmony tokens' ids in a vocabulary of `vocab_size`."""
    first = vocab_size - len(HARMONY_TOKENS)
    return {token: first + k for k, token in enumerate(HARMONY_TOKENS)}


def config_entries(vocab_size: int) -> dict[str, Any]:
    """config.json's special token ids (GPT-OSS's roles for them)."""
    ids = token_ids(vocab_size)
    return {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}


def generation_config(vocab_size: int) -> dict[str, Any]:
    ids = token_ids(vocab_size)
    return {"bos_token_id": ids[BOS], "eos_token_id": [ids[t] for t in STOP_TOKENS],
            "pad_token_id": ids[PAD], "do_sample": False}


def add_tokens(tokenizer, vocab_size: int) -> None:
    """Appends reserved tokens up to the harmony block, then the harmony tokens (a `tokenizers`
    Tokenizer trained to at most vocab_size - len(HARMONY_TOKENS) tokens)."""
    from tokenizers import AddedToken
    first = vocab_size - len(HARMONY_TOKENS)
    have = tokenizer.get_vocab_size(with_added_tokens=True)
    if have > first:
        raise ValueError(f"the trained vocabulary ({have}) leaves no room for the harmony tokens")
    names = [f"<|reserved_{i}|>" for i in range(have, first)] + list(HARMONY_TOKENS)
    tokenizer.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    assert tokenizer.token_to_id(HARMONY_TOKENS[-1]) == vocab_size - 1


# The TypeScript-like type of a JSON schema, as harmony writes tool parameters.
_TS_TYPE = r"""
{%- macro ts_type(s) -%}
{%- if s is not mapping -%}any
{%- elif s.enum is defined -%}{% for v in s.enum %}{{ v | tojson }}{% if not loop.last %} | {% endif %}{% endfor %}
{%- elif s.type is defined and s.type is not string -%}{% for t in s.type %}{{ ts_type({'type': t}) }}{% if not loop.last %} | {% endif %}{% endfor %}
{%- elif s.type == 'string' -%}string
{%- elif s.type in ('number', 'integer') -%}number
{%- elif s.type == 'boolean' -%}boolean
{%- elif s.type == 'null' -%}null
{%- elif s.type == 'array' -%}{{ ts_type(s['items'] if s['items'] is defined else {}) }}[]
{%- elif s.type == 'object' and s.properties is defined -%}{
{% for name, p in s.properties.items() -%}
{% if p.description is defined %}// {{ p.description }}
{% endif %}{{ name }}{% if name not in (s.required or []) %}?{% endif %}: {{ ts_type(p) }},
{% endfor %}}
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
"""

CHAT_TEMPLATE = _TS_TYPE + r"""
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}
{%- set identity = model_identity if model_identity is defined and model_identity else 'You are ChatGPT, a large language model trained by OpenAI.' -%}
{{- '<|start|>system<|message|>' + identity + '\nKnowledge cutoff: 2024-06\n' -}}
{%- if current_date is defined and current_date %}{{ 'Current date: ' + current_date + '\n' }}{% endif -%}
{{- '\nReasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
{{- '<|end|>' -}}
{%- set ns = namespace(instructions=[], last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role in ('system', 'developer') and m.content %}{% set ns.instructions = ns.instructions + [m.content] %}{% endif -%}
{%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- if ns.instructions or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if ns.instructions %}{{ '# Instructions\n\n' + ns.instructions | join('\n\n') }}{% endif -%}
{%- if tools -%}
{%- if ns.instructions %}{{ '\n\n' }}{% endif -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{%- if f.description %}{{ '// ' + f.description + '\n' }}{% endif -%}
{{- 'type ' + f.name + ' = (' -}}
{%- if f.parameters and f.parameters.properties %}{{ '_: ' + ts_type(f.parameters) }}{% endif -%}
{{- ') => any;\n\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- set calls = namespace(ids=[], names=[], last='') -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' -%}
{%- set thinking = m.thinking if m.thinking is defined and m.thinking else (m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '') -%}
{%- if m.tool_calls -%}
{%- if thinking and loop.index0 > ns.last_user %}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>{% endif -%}
{%- if m.content %}<|start|>assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{% endif -%}
{%- for c in m.tool_calls -%}
{%- set f = c.function if c.function is defined else c -%}
{%- set calls.last = f.name -%}
{%- set calls.ids = calls.ids + [c.id] -%}
{%- set calls.names = calls.names + [f.name] -%}
<|start|>assistant<|channel|>commentary to=functions.{{ f.name }} <|constrain|>json<|message|>
{%- if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}<|call|>
{%- endfor -%}
{%- elif loop.last and continue_final_message is defined and continue_final_message -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}
{%- else -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- set found = namespace(name=m.name if m.name is defined and m.name else calls.last) -%}
{%- if not (m.name is defined and m.name) -%}
{%- for i in range(calls.ids | length) %}{% if calls.ids[i] and calls.ids[i] == m.tool_call_id %}{% set found.name = calls.names[i] %}{% endif %}{% endfor -%}
{%- endif -%}
<|start|>functions.{{ found.name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}
"""
