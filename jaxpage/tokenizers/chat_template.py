"""A chat template given by the user (`--chat-template`, as vLLM's): a file, or the template itself."""

from __future__ import annotations

import codecs
from pathlib import Path

from jaxpage.validation import check_text

JINJA_CHARACTERS = "{}\n"  # text holding one of these is a template; other text names a file


def read_chat_template(value: str) -> str:
    """The template `value` gives: a file's text, or `value` itself when it is no file and holds Jinja's characters
    (its escapes such as \\n read as vLLM reads them). ValueError naming chat_template for a file that cannot be read
    or a template Jinja cannot parse."""
    check_text("chat_template", value)
    path = Path(value).expanduser()
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if isinstance(e, UnicodeDecodeError) or not any(c in value for c in JINJA_CHARACTERS):
            raise ValueError(f"chat_template {value!r} is no readable file ({type(e).__name__}: {e})") from None
        try:
            template = codecs.decode(value, "unicode_escape")
        except UnicodeDecodeError as e:
            raise ValueError(f"chat_template: its escapes cannot be read ({e})") from None
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is no Jinja template: line {e.lineno}: {e.message}") from None
    return template
