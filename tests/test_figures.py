"""The figures read on their own: a run's perplexity axis always has labels, and the heatmap's
title and colour-bar labels lie inside the figure however few task columns it has."""
import pandas as pd
import pytest

from posbench.results import heatmap_figure, run_figure, scaling_figure


def run_rows(perplexities: list[float]) -> list[dict]:
    ratios = [0.5, 1, 2, 4][: len(perplexities)]
    return [{"status": "ok", "ratio": r, "perplexity": p, "token_acc": 0.3, "encoding": "rope", "task": "wikitext",
             "seed": 0, "train_length": 64} for r, p in zip(ratios, perplexities)]


def visible_y_labels(ax) -> list[str]:
    """The non-empty y tick labels (major and minor) inside the view, after drawing."""
    low, high = sorted(ax.get_ylim())
    return [t.get_text() for t in ax.yaxis.get_majorticklabels() + ax.yaxis.get_minorticklabels()
            if t.get_text() and low <= t.get_position()[1] <= high]


@pytest.mark.parametrize("perplexities", [[190, 180, 210, 260], [150, 110, 130, 190], [12, 13, 19], [2, 30, 900]])
def test_perplexity_axis_is_labelled_whatever_the_range(perplexities):
    """Inside one decade a log axis can hold no labelled tick at all (110..190 did); across
    decades it holds its powers of ten."""
    fig = run_figure(run_rows(perplexities))
    fig.canvas.draw()
    labels = visible_y_labels(fig.axes[0])
    assert fig.axes[0].get_ylabel() == "perplexity"
    assert len(labels) >= 2, labels


def inside(fig, text) -> bool:
    box = text.get_window_extent(fig.canvas.get_renderer())
    return fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1


@pytest.mark.parametrize("tasks", [{"copy": "exact_match"}, {"wikitext": "perplexity"},
                                   {"copy": "exact_match", "wikitext": "perplexity"}])
def test_heatmap_title_and_colour_bar_labels_lie_inside_the_figure(tasks):
    headline = pd.DataFrame([{"label": label, "task": task, "metric": metric,
                              "ood_score_mean": 0.4 if metric == "exact_match" else 200.0 + 10 * i}
                             for task, metric in tasks.items() for i, label in enumerate(["rope", "alibi base=5"])])
    fig = heatmap_figure(headline)
    fig.canvas.draw()
    bar_labels = [ax.yaxis.label for ax in fig.axes[1:]]
    assert [label.get_text().split("\n")[0] for label in bar_labels] == sorted(set(tasks.values()))
    (title,) = fig.texts  # the suptitle
    assert title.get_text().startswith("OOD score")
    assert all(inside(fig, text) for text in [title, *bar_labels])


def test_scaling_figure_has_a_panel_per_task_setting_and_a_colour_per_encoding():
    """Copy variants are not one task for the comparison: cmc and rsc get panels of their own,
    and an encoding keeps its colour from panel to panel."""
    rows = [{"task": task, "setting": setting, "encoding_label": encoding, "n_params": n, "metric": "exact_match",
             "ood_score_mean": score, "ood_score_min": score - 0.1, "ood_score_max": score + 0.1}
            for task, setting in [("copy", "variant=cmc"), ("copy", "variant=rsc"), ("sort", "")]
            for encoding, score in [("alibi", 0.5), ("nope", 0.3)] for n in (26_000, 151_000)]
    fig = scaling_figure(pd.DataFrame(rows))
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["copy variant=cmc", "copy variant=rsc", "sort"]
    for ax in panels:
        assert ax.get_legend_handles_labels()[1] == ["alibi", "nope"]
    colours = {tuple(ax.get_legend_handles_labels()[0][0].lines[0].get_color()) for ax in panels}
    assert len(colours) == 1  # alibi's line has one colour in all three panels


def test_a_figure_is_saved_as_a_palette_png_of_the_same_picture(tmp_path):
    """save_png: at most 256 colours, fewer bytes than matplotlib's RGBA PNG, the same size, and pixels within
    a few levels of it (the quantised colours of anti-aliased edges)."""
    import numpy as np
    from PIL import Image

    from posbench.results import save_png

    fig = run_figure(run_rows([190, 180, 210, 260]))
    full, small = tmp_path / "full.png", tmp_path / "small.png"
    fig.savefig(full, dpi=120)
    save_png(fig, small)
    reference, saved = Image.open(full).convert("RGB"), Image.open(small)
    assert saved.mode == "P" and saved.size == reference.size
    assert small.stat().st_size < 0.6 * full.stat().st_size
    difference = np.abs(np.asarray(saved.convert("RGB"), dtype=int) - np.asarray(reference, dtype=int))
    assert np.mean(difference) < 1.0 and np.percentile(difference, 99.9) < 40
