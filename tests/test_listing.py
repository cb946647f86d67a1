"""The shared pieces of every report: the Pareto front (against a brute-force search of dominated
points), the shortened list, and the files a release publishes."""

from __future__ import annotations

import random

import pytest

from ggufcarve.fileio import published_files
from ggufcarve.listing import pareto_front, shortened


def _brute_front(points: list[tuple[int, float]]) -> list[int]:
    """Indices of the points no other point dominates (<= in both, < in one), by definition."""
    return [
        i
        for i, (s, v) in enumerate(points)
        if not any(j != i and t <= s and w <= v and (t < s or w < v) for j, (t, w) in enumerate(points))
    ]


@pytest.mark.parametrize("seed", range(40))
def test_pareto_front_is_the_set_of_undominated_points(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    points = [
        (rng.randint(1, 6), rng.choice([0.1, 0.2, 0.3, 0.4])) for _ in range(n)
    ]  # few values: ties of size, value and both
    front = pareto_front(range(n), lambda i: points[i][0], lambda i: points[i][1])
    assert sorted(front) == _brute_front(points)
    assert [points[i] for i in front] == sorted(points[i] for i in front)  # smallest first


def test_pareto_front_of_evaluated_models_leaves_out_a_larger_model_of_equal_kld():
    from ggufcarve.evaluate.summary import pareto_front as model_front

    def result(name, gib, kld):
        return {"model": {"name": name, "bytes": int(gib * 2**30)}, "kld_mean": kld}

    results = [result("a", 4.0, 0.2), result("b", 6.0, 0.2), result("c", 8.0, 0.1), result("d", 8.0, 0.1)]
    assert model_front(results) == {"a", "c", "d"}


@pytest.mark.parametrize(
    "items, shown, separator, expected",
    [
        ([], 3, "; ", ""),
        (["a"], 1, "; ", "a"),
        (["a", "b"], 1, "; ", "a (+1 more)"),
        (["a", "b", "c", "d", "e"], 3, ", ", "a, b, c (+2 more)"),
        (["a", "b", "c"], 3, ", ", "a, b, c"),
    ],
)
def test_shortened(items, shown, separator, expected):
    assert shortened(items, shown, separator) == expected


def test_published_files_leave_out_hidden_and_temp_names(tmp_path):
    for rel in (
        "b.gguf",
        "a.gguf",
        "SHA256SUMS",
        "evaluation/x.json",
        "evaluation/.hidden",
        ".a.gguf.ggufcarve-12.tmp",
        ".ggufcarve-fragments/Q4_K_M.json",
        "method/sub/deep.json",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    names = [p.relative_to(tmp_path).as_posix() for p in published_files(tmp_path, leave_out=("SHA256SUMS",))]
    assert names == ["a.gguf", "b.gguf", "evaluation/x.json", "method/sub/deep.json"]
    assert [p.relative_to(tmp_path / "evaluation").as_posix() for p in published_files(tmp_path / "evaluation")] == [
        "x.json"
    ]
    assert published_files(tmp_path / "missing") == []
