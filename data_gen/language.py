"""Language identification for prompts, with py3langid (its model ships inside its wheel)."""

from __future__ import annotations

import functools
from typing import Any

# Written languages with a large web presence. Restricting the label set keeps mass from
# leaking to close varieties the model also knows (Nigerian Pidgin for short English, Wu
# and Cantonese for short Mandarin), which would make ordinary prompts look uncertain.
LANGUAGES = (
    "af ar az be bg bn ca cs cy da de el en eo es et eu fa fi fr ga gl gu he hi hr hu hy id is it ja ka kk km "
    "kn ko ky lo lt lv mk ml mn mr ms my ne nl no pa pl ps pt ro ru si sk sl sq sr sv sw ta te th tl tr uk ur "
    "uz vi yo zh"
).split()


@functools.cache
def _identifier() -> Any:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    identifier.set_languages(LANGUAGES)
    return identifier


def detect_language(text: str, min_probability: float = 0.8, max_chars: int = 2000) -> str:
    """ISO 639-1 code of ``text``, or ``"und"`` when unsure (short, code-like or mixed text)."""
    sample = text[:max_chars]
    if sum(ch.isalpha() for ch in sample) < 12:
        return "und"
    language, probability = _identifier().classify(sample)
    return language if probability >= min_probability else "und"
