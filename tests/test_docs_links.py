"""Every docs/ or tools/ path the tree cites exists, and every heading cited beside a document
(`docs/kernels.md, "Fused epilogues"`) is one of its headings: comments cite headings instead of
run numbers, so renaming a heading or moving a file must update its citations. docs/archive/ is
history and is not checked."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".sh", ".sbatch", ".toml", ".ini"}
PATH = re.compile(r"(?<![\w/.])((?:docs|tools)/[\w./-]*[\w/])")
# docs' own links, relative to docs/: `kernels.md`, `archive/moe_notes.md`, `results/ttq_small_8min/`
DOCS_PATH = re.compile(r"`((?:archive|results)/[\w./-]*[\w/]|[\w-]+\.md)`")
# a document, then its heading in double quotes: `docs/x.md`, "Heading" or (docs/x.md, "Heading")
CITE = re.compile(r"([\w./-]+\.md)`?,? \"([^\"]+)\"")
# line breaks inside a citation, with the comment marker of the next line
WRAP = re.compile(r"\s*\n\s*(?:#+ )?")


def tracked_files():
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]  # new files too
    out = subprocess.run(listing, cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in out.splitlines():
        path = REPO / name
        own = path == Path(__file__).resolve()  # its examples are not citations
        if path.suffix in SUFFIXES and not name.startswith("docs/archive/") and not own and path.is_file():
            yield name, path


def has_heading(doc: Path, cited: str) -> bool:
    """The heading itself, or its part before a date or a subtitle (the archive's dated headings)."""
    found = (m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M))
    return any(h == cited or h.startswith((cited + ":", cited + " (")) for h in found)


def resolve(name: str, citing: str) -> Path:
    """A cited .md: from the repository root, else beside the citing file (docs' own links)."""
    path = REPO / name
    return path if path.exists() else REPO / Path(citing).parent / name


def test_cited_paths_exist():
    checked, missing = 0, []
    for name, path in tracked_files():
        text = path.read_text(errors="replace")
        cites = [m.group(1).rstrip(".") for m in PATH.finditer(text)]
        if name.startswith("docs/"):
            cites += ["docs/" + m.group(1) for m in DOCS_PATH.finditer(text)]
        for cited in cites:
            checked += 1
            if not (REPO / cited).exists():
                missing.append(f"{name}: {cited}")
    assert checked >= 20, f"only {checked} cited paths found: the pattern no longer matches them"
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_cited_headings_exist():
    checked, wrong = 0, []
    for name, path in tracked_files():
        text = WRAP.sub(" ", path.read_text(errors="replace"))
        for m in CITE.finditer(text):
            doc = resolve(m.group(1), name)
            if not doc.exists():
                continue  # a file name in prose (README.md, "..."): the path test covers real citations
            checked += 1
            if not has_heading(doc, m.group(2)):
                wrong.append(f"{name}: {m.group(1)}, \"{m.group(2)}\"")
    assert checked >= 10, f"only {checked} heading citations found: the pattern no longer matches them"
    assert not wrong, "cited headings that do not exist:\n" + "\n".join(wrong)
