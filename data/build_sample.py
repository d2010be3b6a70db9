"""Rebuild the offline sample corpus in data/sample/ (run once; its output is committed).

The sample is real English prose of very different lengths: the docstrings of Python's standard library
(modules, classes, functions), read with `ast` so nothing is imported or executed. It needs no download, and
its documents range from one line to several pages, which is what exercises packing and padding.

    python data/build_sample.py            # writes data/sample/{train,validation}.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sysconfig
from pathlib import Path

# A fixed list so the corpus does not depend on which optional modules an interpreter has.
MODULES = """
abc argparse ast asyncio/base_events asyncio/events asyncio/futures asyncio/locks asyncio/queues asyncio/streams
asyncio/tasks base64 bdb bisect calendar cmd codecs collections/__init__ colorsys configparser contextlib copy
csv dataclasses datetime decimal difflib dis doctest email/message email/parser email/utils enum filecmp
fileinput fnmatch fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html/parser http/client
http/cookies http/server imaplib inspect io ipaddress json/__init__ json/decoder json/encoder locale logging/__init__
logging/handlers mailbox mimetypes netrc numbers operator optparse os pathlib pdb pickle pickletools pkgutil
platform plistlib poplib pprint profile pstats queue quopri random re/__init__ reprlib sched secrets selectors
shelve shlex shutil smtplib socket socketserver statistics string subprocess sysconfig tabnanny tarfile
tempfile textwrap threading timeit token tokenize trace traceback turtle typing unittest/case unittest/mock
urllib/parse urllib/request uuid warnings wave weakref xml/dom/minidom xml/etree/ElementTree zipfile zipimport
""".split()


def docstrings(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and len(text.split()) >= 8:
                yield text.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "sample"))
    parser.add_argument("--validation_every", type=int, default=20, help="every Nth document goes to validation")
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen, docs = set(), []
    for name in MODULES:
        for text in docstrings(stdlib / f"{name}.py"):
            digest = hashlib.sha1(text.encode()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                docs.append({"text": text, "source": name.replace("/", ".")})

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "validation": []}
    for i, doc in enumerate(docs):
        splits["validation" if i % args.validation_every == 0 else "train"].append(doc)
    for split, rows in splits.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        words = sum(len(r["text"].split()) for r in rows)
        print(f"{split}: {len(rows)} documents, {words} words -> {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
