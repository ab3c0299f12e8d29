"""`--chat-template`: a Jinja template file, or the name of one built in here, for checkpoints
whose tokenizer has no template (or to replace it)."""

from pathlib import Path

# ChatML (Qwen's, without tools): the common format of checkpoints that ship none.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

BUILTIN = {"chatml": CHATML}


def load_chat_template(value: str | None) -> str | None:
    """The template text of `--chat-template` (a file path or a built-in name), or None."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if value in BUILTIN:
        return BUILTIN[value]
    raise ValueError(f"--chat-template {value!r} is neither a file nor a built-in template "
                     f"({', '.join(BUILTIN)})")
