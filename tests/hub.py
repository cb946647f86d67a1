"""What the Hugging Face Hub reads of a model card, as an oracle kept apart from ggufcarve's own
rules: the license identifiers it knows, its repo-id rule, and the card's problems as it would see them."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

# The license identifiers of the Hub's model cards (huggingface.js ApiModelMetadata, the Hub's
# "Licenses" page): the oracle, kept apart from ggufcarve's own list.
HUB_LICENSES = {
    "apache-2.0",
    "mit",
    "openrail",
    "bigscience-openrail-m",
    "creativeml-openrail-m",
    "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m",
    "afl-3.0",
    "artistic-2.0",
    "bsl-1.0",
    "bsd",
    "bsd-2-clause",
    "bsd-3-clause",
    "bsd-3-clause-clear",
    "c-uda",
    "cc",
    "cc0-1.0",
    "cc-by-2.0",
    "cc-by-2.5",
    "cc-by-3.0",
    "cc-by-4.0",
    "cc-by-sa-3.0",
    "cc-by-sa-4.0",
    "cc-by-nc-2.0",
    "cc-by-nc-3.0",
    "cc-by-nc-4.0",
    "cc-by-nd-4.0",
    "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0",
    "cc-by-nc-sa-2.0",
    "cc-by-nc-sa-3.0",
    "cc-by-nc-sa-4.0",
    "cdla-sharing-1.0",
    "cdla-permissive-1.0",
    "cdla-permissive-2.0",
    "wtfpl",
    "ecl-2.0",
    "epl-1.0",
    "epl-2.0",
    "etalab-2.0",
    "eupl-1.1",
    "agpl-3.0",
    "gfdl",
    "gpl",
    "gpl-2.0",
    "gpl-3.0",
    "lgpl",
    "lgpl-2.1",
    "lgpl-3.0",
    "isc",
    "lppl-1.3c",
    "ms-pl",
    "mpl-2.0",
    "odc-by",
    "odbl",
    "openrail++",
    "osl-3.0",
    "postgresql",
    "ofl-1.1",
    "ncsa",
    "unlicense",
    "zlib",
    "pddl",
    "lgpl-lr",
    "deepfloyd-if-license",
    "llama2",
    "llama3",
    "llama3.1",
    "llama3.2",
    "llama3.3",
    "gemma",
    "unknown",
    "other",
}
# huggingface_hub's validate_repo_id, with the namespace required (a base model is OWNER/NAME)
HUB_REPO_ID = re.compile(r"^[\w\-.]+/[\w\-.]{1,96}$", re.ASCII)
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def hub_problems(release: Path) -> tuple[dict, list[str]]:
    """The card's front matter and what the Hub would not accept or show: YAML, base_model a repo
    id (absent is reported as such), a license it knows, every linked or embedded file present."""
    text = (release / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert isinstance(front, dict)
    problems = []
    base = front.get("base_model")
    if base is None:
        problems.append("no base_model")
    elif not all(
        HUB_REPO_ID.match(b) and "--" not in b and ".." not in b for b in (base if isinstance(base, list) else [base])
    ):
        problems.append(f"base_model {base!r} is not a repo id")
    if front.get("license") not in HUB_LICENSES:
        problems.append(f"license {front.get('license')!r}")
    elif front["license"] == "other" and not (front.get("license_name") and front.get("license_link")):
        problems.append("license other without name and link")
    listed = {line.split("  ", 1)[1] for line in (release / "SHA256SUMS").read_text().splitlines()}
    for target in MD_LINK.findall(text):
        if "://" not in target:
            if not (release / target).is_file() or target not in listed:
                problems.append(f"links {target}, not published")
    return front, problems
