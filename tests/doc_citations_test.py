"""Every document a source comment cites exists in the repository: the `.md` names in the comments and docstrings of
the sources (C++, CUDA, Python, shell, CMake) are looked up, and the test fails naming each one that is not there.
First it shows that it finds one: a citation of a missing document planted in a tree of its own must be reported.

A citation resolves when the path exists from the repository's root or from the citing file's folder, when a bare
name is the name of a file of the repository (`SCHEMA.md`), or when a pattern (`docs/findings/fa-3-*.md`) matches
one. Not citations: web addresses (an upstream project's document is cited by its address), and files a program
writes, named with a placeholder folder (`DIR/summary.md`, `$OUT/table.md`).

    python3 tests/doc_citations_test.py [REPO]        (CTest: doc_citations)
"""
import ast
import glob
import io
import os
import re
import subprocess
import sys
import tempfile
import tokenize

SOURCE = re.compile(r"\.(py|sh|cpp|hpp|cu|cuh|h|c|cmake)$|(^|/)CMakeLists\.txt$")
CITATION = re.compile(r"[\w./*$-]*\.md\b")


def listed(root):
    """The repository's files, as git lists them (tracked and untracked but not ignored), or every file outside
    build and hidden folders where there is no git checkout."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return [p for p in out if p and os.path.isfile(os.path.join(root, p))]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(("build", "."))]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names]
        return files


def comments(path, text):
    """(line, text) of every comment of a source file, and of every docstring of a Python file."""
    if path.endswith(".py"):
        found = []
        try:
            for t in tokenize.generate_tokens(io.StringIO(text).readline):
                if t.type == tokenize.COMMENT:
                    found.append((t.start[0], t.string))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        found.append((node.body[0].lineno, doc))
        except (SyntaxError, tokenize.TokenError, ValueError):
            found.append((1, text))   # a file Python cannot read: all of it, so that nothing escapes
        return found
    if path.endswith((".sh", ".cmake")) or path.endswith("CMakeLists.txt"):
        found = []
        for i, line in enumerate(text.split("\n")):
            m = re.search(r"(^|\s)#", line)
            if m:
                found.append((i + 1, line[m.start():]))
        return found
    code = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)   # C, C++, CUDA: string literals are not comments
    return [(code.count("\n", 0, m.start()) + 1, m.group()) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", code, re.S)]


def placeholder(citation):
    """Whether a citation names a file a program writes: its folder is a placeholder (DIR, OUT, $RESULTS, ...)."""
    folder = citation.rsplit("/", 1)[0] if "/" in citation else ""
    first = folder.split("/")[0]
    return first.startswith("$") or (first.isupper() and first.isalpha())


def missing(root, files):
    """(file, line, citation) of every cited document that is not in the repository."""
    names = {os.path.basename(p) for p in files}
    found = []
    for path in files:
        if not SOURCE.search(path):
            continue
        with open(os.path.join(root, path), errors="replace") as f:
            text = f.read()
        for line, comment in comments(path, text):
            for m in CITATION.finditer(comment):
                cited = m.group()
                word = re.split(r"\s", comment[:m.start()])[-1] + cited   # the whole word the name stands in
                if "://" in word or placeholder(cited) or cited == ".md":
                    continue
                here = os.path.dirname(os.path.join(root, path))
                if "*" in cited:
                    ok = bool(glob.glob(os.path.join(root, cited)) or glob.glob(os.path.join(here, cited)))
                else:
                    ok = os.path.exists(os.path.join(root, cited)) or os.path.exists(os.path.join(here, cited)) or \
                        ("/" not in cited and cited in names)
                if not ok:
                    found.append((path, line, cited))
    return found


def planted_is_found():
    """A tree whose comments cite one document that is there, one by address, one output file and one that is not
    there: only the last is reported."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {"docs/here.md": "", "a/b.py": '"""See docs/here.md and https://example.org/x/README.md."""\n'
                 "# writes DIR/summary.md\n# and notes-nowhere.md\n"}
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w") as f:
                f.write(text)
        return missing(tmp, sorted(files)) == [("a/b.py", 3, "notes-nowhere.md")]


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    if not planted_is_found():
        print("doc_citations: the planted citation of a missing document was not reported as the only one: the check "
              "itself is broken")
        return 1
    files = listed(root)
    found = missing(root, files)
    for path, line, cited in found:
        print(f"{path}:{line} cites {cited}, which is not in the repository")
    print(f"doc_citations: {sum(1 for p in files if SOURCE.search(p))} sources read, {len(found)} citation(s) of a "
          "document that is not there")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
