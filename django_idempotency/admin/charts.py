"""Charts of the overview's hours, drawn on the server as inline SVG: bars (stacked or side by
side) and lines, with their axes, labels and an accessible title; no JavaScript, nothing from
a CDN.

Colours come from CSS classes (``idempotency-tone-*`` in ``styles.html``) and the admin's own
variables, so the charts follow its light and dark themes. Every bar and point carries a
``<title>`` (its hour and value, shown on hover and read by screen readers), and the page puts
the same numbers in a table under each chart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from django.utils import timezone
from django.utils.formats import number_format
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _

from django_idempotency.operations.overview import HOUR

__all__ = ["Chart", "Series", "format_count", "format_seconds", "hour_label", "hour_range"]

#: The drawing's size in SVG units; the page scales it to its column.
WIDTH, HEIGHT = 560, 220
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 24
#: Hours between two labels of the time axis.
LABEL_EVERY = 3
#: Tick values of the logarithmic (duration) axis, in seconds.
LOG_TICKS = (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 600.0, 3600.0, 36000.0, 864000.0)

Kind = Literal["stacked", "grouped", "lines"]


def format_count(value: float) -> str:
    return str(number_format(int(round(value)), force_grouping=True))


def _compact(value: float) -> str:
    """An axis label: 950, 1.5k, 20k, 3M."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}".removesuffix(".0") + suffix
    return f"{value:.1f}".removesuffix(".0")


def format_seconds(value: float) -> str:
    """A duration for a person: 40 ms, 1.2 s, 3 min, 2.5 h."""
    if value < 1:
        return _("%(n)s ms") % {"n": f"{value * 1000:.0f}"}
    for size, unit in ((3600, _("h")), (60, _("min"))):
        if value >= size:
            return f"{value / size:.1f}".removesuffix(".0") + f" {unit}"
    return _("%(n)s s") % {"n": f"{value:.1f}".removesuffix(".0")}


def hour_label(hour: datetime) -> str:
    return timezone.localtime(hour).strftime("%H:%M")


def hour_range(hour: datetime, last: bool) -> str:
    end = _("now") if last else hour_label(hour + HOUR)
    return f"{hour_label(hour)}–{end}"


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    values: tuple[float | None, ...]
    #: The colour: the CSS class ``idempotency-tone-<tone>``.
    tone: str
    #: Where the rows behind the series are listed, if anywhere.
    url: str | None = None


@dataclass(frozen=True, slots=True)
class Chart:
    """A chart over hours: ``series`` values, one per hour of ``hours`` (their starts)."""

    key: str
    title: str
    description: str
    hours: tuple[datetime, ...]
    series: tuple[Series, ...]
    kind: Kind = "stacked"
    #: Values are durations in seconds, drawn on a logarithmic axis.
    seconds: bool = False
    #: Said instead of the chart when it has nothing to draw.
    empty_text: str = ""

    # --- what the template shows besides the drawing ---

    @property
    def empty(self) -> bool:
        return not any(value for series in self.series for value in series.values)

    @property
    def element_id(self) -> str:
        return f"idempotency-chart-{self.key}"

    def format(self, value: float | None) -> str:
        if value is None:
            return "–"
        return format_seconds(value) if self.seconds else format_count(value)

    def rows(self) -> list[dict[str, object]]:
        """The chart's numbers, hour by hour: its table."""
        last = len(self.hours) - 1
        return [
            {
                "hour": hour_range(hour, index == last),
                "values": [self.format(series.values[index]) for series in self.series],
            }
            for index, hour in enumerate(self.hours)
        ]

    # --- the drawing ---

    def svg(self) -> SafeString:
        scale = _LogScale(self) if self.seconds else _LinearScale(self)
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="idempotency-chart-svg" '
            f'id="{self.element_id}-svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" '
            f'aria-labelledby="{self.element_id}-title {self.element_id}-desc">',
            f'<title id="{self.element_id}-title">{escape(self.title)}</title>',
            f'<desc id="{self.element_id}-desc">{escape(self.description)}</desc>',
            *self._axes(scale),
            *(self._lines(scale) if self.kind == "lines" else self._bars(scale)),
            "</svg>",
        ]
        return mark_safe("".join(parts))  # noqa: S308 - every text in it is escaped

    @property
    def _slot(self) -> float:
        return (WIDTH - LEFT - RIGHT) / max(len(self.hours), 1)

    def _x(self, index: int) -> float:
        return LEFT + index * self._slot

    def _axes(self, scale: _Scale) -> list[str]:
        parts = []
        for value in scale.ticks:
            y = scale.y(value)
            parts.append(
                f'<line class="idempotency-grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" '
                f'y1="{y:.1f}" y2="{y:.1f}"/>'
                f'<text class="idempotency-axis" x="{LEFT - 6}" y="{y + 4:.1f}" '
                f'text-anchor="end">{escape(scale.label(value))}</text>'
            )
        base = HEIGHT - BOTTOM
        parts.append(
            f'<line class="idempotency-baseline" x1="{LEFT}" x2="{WIDTH - RIGHT}" '
            f'y1="{base}" y2="{base}"/>'
        )
        for index, hour in enumerate(self.hours):
            if timezone.localtime(hour).hour % LABEL_EVERY:
                continue
            x = self._x(index)
            parts.append(
                f'<line class="idempotency-tick" x1="{x:.1f}" x2="{x:.1f}" y1="{base}" '
                f'y2="{base + 4}"/><text class="idempotency-axis" x="{x:.1f}" '
                f'y="{HEIGHT - 6}" text-anchor="middle">{escape(hour_label(hour))}</text>'
            )
        return parts

    def _title(self, index: int, series: Series, value: float | None) -> str:
        last = index == len(self.hours) - 1
        text = f"{hour_range(self.hours[index], last)} · {series.label}: {self.format(value)}"
        return f"<title>{escape(text)}</title>"

    def _bars(self, scale: _Scale) -> list[str]:
        parts = []
        slot = self._slot
        gap = slot * 0.15
        width = slot - 2 * gap
        count = len(self.series)
        for index in range(len(self.hours)):
            below = 0.0
            for number, series in enumerate(self.series):
                value = series.values[index]
                if not value:
                    continue
                if self.kind == "stacked":
                    top, bottom = scale.y(below + value), scale.y(below)
                    x, bar_width = self._x(index) + gap, width
                    below += value
                else:
                    top, bottom = scale.y(value), scale.y(0)
                    bar_width = width / count
                    x = self._x(index) + gap + number * bar_width
                height = max(bottom - top, 1.0)  # a value above zero is never invisible
                parts.append(
                    f'<rect class="idempotency-tone-{escape(series.tone)}" x="{x:.1f}" '
                    f'y="{bottom - height:.1f}" width="{bar_width:.1f}" height="{height:.1f}">'
                    f"{self._title(index, series, value)}</rect>"
                )
        return parts

    def _lines(self, scale: _Scale) -> list[str]:
        parts = []
        for series in self.series:
            tone = f"idempotency-tone-{escape(series.tone)}"
            points = [
                (index, self._x(index) + self._slot / 2, scale.y(value), value)
                for index, value in enumerate(series.values)
                if value is not None
            ]
            # A line joins consecutive hours only: an hour without a value breaks it.
            path, previous = [], None
            for index, x, y, _value in points:
                path.append(f"{'L' if previous == index - 1 else 'M'}{x:.1f} {y:.1f}")
                previous = index
            if path:
                parts.append(f'<path class="idempotency-line {tone}" d="{" ".join(path)}"/>')
            for index, x, y, value in points:
                parts.append(
                    f'<circle class="idempotency-point {tone}" cx="{x:.1f}" cy="{y:.1f}" r="2.5">'
                    f"{self._title(index, series, value)}</circle>"
                )
        return parts


class _Scale:
    ticks: Sequence[float]
    label: Callable[[float], str]

    def y(self, value: float) -> float:  # pragma: no cover - every scale has its own
        raise NotImplementedError


class _LinearScale(_Scale):
    """From zero to a round number above the largest bar (or point), four or five ticks."""

    def __init__(self, chart: Chart) -> None:
        if chart.kind == "stacked":
            largest = max(
                (sum(s.values[i] or 0 for s in chart.series) for i in range(len(chart.hours))),
                default=0,
            )
        else:
            largest = max((v or 0 for s in chart.series for v in s.values), default=0)
        step = max(_nice(max(largest, 1) / 4), 1.0)  # counts: whole steps
        self.top = step * max(math.ceil(largest / step), 1)
        self.ticks = [step * n for n in range(int(round(self.top / step)) + 1)]
        self.label = _compact

    def y(self, value: float) -> float:
        plot = HEIGHT - TOP - BOTTOM
        return HEIGHT - BOTTOM - plot * min(value, self.top) / self.top


class _LogScale(_Scale):
    """Durations: powers of ten (and a minute, an hour) around the values drawn."""

    def __init__(self, chart: Chart) -> None:
        values = [v for s in chart.series for v in s.values if v is not None]
        low = max(min(values, default=0.1), LOG_TICKS[0])
        high = max(max(values, default=1.0), low)
        self.low = max((t for t in LOG_TICKS if t <= low), default=LOG_TICKS[0])
        self.high = min((t for t in LOG_TICKS if t >= high), default=LOG_TICKS[-1])
        if self.high <= self.low:
            self.high = next(t for t in LOG_TICKS if t > self.low)
        self.ticks = [t for t in LOG_TICKS if self.low <= t <= self.high]
        self.label = format_seconds

    def y(self, value: float) -> float:
        plot = HEIGHT - TOP - BOTTOM
        value = min(max(value, self.low), self.high)
        share = math.log(value / self.low) / math.log(self.high / self.low)
        return HEIGHT - BOTTOM - plot * share


def _nice(step: float) -> float:
    """The round number (1, 2 or 5 times a power of ten) at or above ``step``."""
    magnitude = 10 ** math.floor(math.log10(step))
    for multiple in (1, 2, 5, 10):
        if multiple * magnitude >= step:
            return float(multiple * magnitude)
    return float(10 * magnitude)  # pragma: no cover - 10 always fits
