"""A toy desktop for a GUI agent: a pure, deterministic state machine and a PIL renderer of its screen.

Why a toy and not a real desktop: an RL example needs an environment that is cheap (thousands of episodes), exactly
reproducible from a seed, and whose goal can be checked from its state rather than from pixels. The screen is small
(320x240, so a screenshot is a few dozen image tokens for Qwen3-VL) and drawn with PIL's built-in bitmap font, so the
same state always gives the same pixels on any machine.

The desktop has app icons (Notes, Files, Trash), windows with a title bar and a close box, buttons, one text field
(the note) and sometimes a modal "Update available" dialog that blocks everything else until it is dismissed. The
agent acts with two actions: `Click(x, y)` (screen pixels, (0, 0) top-left) and `TypeText(text)` (into the focused
text field). The goal: open Notes, type a given word, press Save; `reward` is 1.0 once a saved note equals the word.
`expert_action` is a solver of the goal from any state: what the scripted demo asks the emulated model to do, and
what the tests use to show that every seed's goal is reachable.

Nothing here does I/O: `step(desktop, action)` returns a new `Desktop`; `render`/`screenshot_png` draw one.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field, replace
from typing import Literal

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 320, 240
TASKBAR_HEIGHT = 16
TITLE_HEIGHT = 14
MAX_TEXT = 24  # the note's text field holds at most this many characters
ICON = 24  # icon square; its clickable cell is ICON_CELL, label included
ICON_CELL = (48, 40)

WORDS = ("apple", "river", "copper", "meadow", "signal", "harbor", "garden", "kernel", "lattice", "cloud", "stone",
         "vector", "amber", "falcon", "violet", "ember", "pebble", "orbit", "willow", "quartz")

Kind = Literal["notes", "files", "trash", "update"]
APPS: tuple[Kind, ...] = ("notes", "files", "trash")
TITLES: dict[str, str] = {"notes": "Notes", "files": "Files", "trash": "Trash", "update": "Update available"}
SIZES: dict[str, tuple[int, int]] = {"notes": (180, 104), "files": (150, 90), "trash": (130, 60),
                                     "update": (176, 66)}
ICON_COLORS: dict[str, tuple[int, int, int]] = {"notes": (246, 214, 92), "files": (110, 160, 230),
                                                "trash": (150, 150, 150)}


@dataclass(frozen=True, slots=True)
class Rect:
    """A pixel box: x, y of its top-left corner, its width and height (right and bottom edges excluded)."""

    x: int
    y: int
    w: int
    h: int

    def contains(self, px: int, py: int) -> bool:
        return self.x <= px < self.x + self.w and self.y <= py < self.y + self.h

    @property
    def center(self) -> tuple[int, int]:
        return self.x + self.w // 2, self.y + self.h // 2


@dataclass(frozen=True, slots=True)
class Click:
    """A left click at screen pixel (x, y)."""

    x: int
    y: int


@dataclass(frozen=True, slots=True)
class TypeText:
    """Keystrokes into the focused text field (printable ASCII; the rest is dropped)."""

    text: str


Action = Click | TypeText


@dataclass(frozen=True, slots=True)
class Window:
    """An open window of `kind`, its top-left corner at (x, y)."""

    kind: Kind
    x: int
    y: int

    @property
    def rect(self) -> Rect:
        w, h = SIZES[self.kind]
        return Rect(self.x, self.y, w, h)


Role = Literal["close", "button", "textfield", "label"]


@dataclass(frozen=True, slots=True)
class Widget:
    """One control of a window, in screen pixels. `name` is `kind.part` (`notes.save`)."""

    name: str
    role: Role
    rect: Rect
    label: str = ""


@dataclass(frozen=True)
class Desktop:
    """The whole state. Windows are listed bottom to top; the last one is in front (a dialog always is)."""

    word: str  # the goal: a saved note equal to this word
    icons: tuple[tuple[Kind, Rect], ...]  # app -> its clickable cell on the desktop
    spawn: tuple[tuple[Kind, int, int], ...]  # app -> where its window opens
    windows: tuple[Window, ...] = ()
    focused: str | None = None  # the focused text field's widget name
    text: str = ""  # the note's text field
    status: str = ""  # the Notes window's status line
    saved: tuple[str, ...] = ()  # every note saved so far, in order
    steps: int = 0
    event: str = field(default="", compare=False)  # what the last action did, in words (the tool's result)

    @property
    def instruction(self) -> str:
        return (f'Open the Notes app, type the word "{self.word}" into the note and press Save. The screen is '
                f"{WIDTH}x{HEIGHT} pixels; (0, 0) is its top-left corner.")

    def window(self, kind: str) -> Window | None:
        return next((w for w in self.windows if w.kind == kind), None)

    @property
    def top(self) -> Window | None:
        return self.windows[-1] if self.windows else None


def new_desktop(seed: int) -> Desktop:
    """The desktop of task `seed`: its word, where the icons sit, where each window opens, and whether the update
    dialog (and a Files window) are open at the start."""
    rng = random.Random(seed)
    word = rng.choice(WORDS)
    cols, rows = (WIDTH - 8) // ICON_CELL[0], (HEIGHT - TASKBAR_HEIGHT - 8) // ICON_CELL[1]
    slots = rng.sample([(c, r) for c in range(cols) for r in range(rows)], len(APPS))
    icons = tuple((app, Rect(4 + c * ICON_CELL[0], 4 + r * ICON_CELL[1], *ICON_CELL))
                  for app, (c, r) in zip(APPS, slots, strict=True))
    spawn = tuple((kind, *_random_corner(rng, kind)) for kind in APPS)
    windows: list[Window] = []
    if rng.random() < 0.4:  # a Files window left open, perhaps over the Notes icon
        windows.append(Window("files", *_random_corner(rng, "files")))
    if rng.random() < 0.5:
        w, h = SIZES["update"]
        windows.append(Window("update", (WIDTH - w) // 2 + rng.randint(-30, 30),
                              (HEIGHT - TASKBAR_HEIGHT - h) // 2 + rng.randint(-20, 20)))
    return Desktop(word=word, icons=icons, spawn=spawn, windows=tuple(windows), event="The desktop is shown.")


def _random_corner(rng: random.Random, kind: str) -> tuple[int, int]:
    w, h = SIZES[kind]
    return rng.randint(0, WIDTH - w), rng.randint(0, HEIGHT - TASKBAR_HEIGHT - h)


def widgets(desktop: Desktop, window: Window) -> tuple[Widget, ...]:
    """The controls of `window` as drawn now, front to back within the window (its layout is fixed)."""
    r, k = window.rect, window.kind
    close = Widget(f"{k}.close", "close", Rect(r.x + r.w - TITLE_HEIGHT, r.y + 1, TITLE_HEIGHT - 2, TITLE_HEIGHT - 2),
                   "x")
    if k == "notes":
        return (close,
                Widget("notes.text", "textfield", Rect(r.x + 6, r.y + 32, r.w - 12, 18), desktop.text),
                Widget("notes.save", "button", Rect(r.x + 6, r.y + 58, 52, 18), "Save"),
                Widget("notes.clear", "button", Rect(r.x + 64, r.y + 58, 52, 18), "Clear"),
                Widget("notes.hint", "label", Rect(r.x + 6, r.y + 18, r.w - 12, 12), "Note:"),
                Widget("notes.status", "label", Rect(r.x + 6, r.y + 84, r.w - 12, 12), desktop.status))
    if k == "files":
        names = [f"note{i + 1}.txt  {text[:12]}" for i, text in enumerate(desktop.saved)][-4:] or ["(no files)"]
        return (close, *(Widget(f"files.item{i}", "label", Rect(r.x + 6, r.y + 20 + 14 * i, r.w - 12, 12), name)
                         for i, name in enumerate(names)))
    if k == "trash":
        return (close, Widget("trash.empty", "label", Rect(r.x + 6, r.y + 24, r.w - 12, 12), "Trash is empty."))
    return (Widget("update.text", "label", Rect(r.x + 6, r.y + 20, r.w - 12, 12), "A new version is ready."),
            Widget("update.later", "button", Rect(r.x + 20, r.y + 40, 60, 18), "Later"),
            Widget("update.install", "button", Rect(r.x + r.w - 80, r.y + 40, 60, 18), "Install"))


def hit(desktop: Desktop, x: int, y: int) -> tuple[Window | None, Widget | None, Kind | None]:
    """What a click at (x, y) lands on: the front-most window there (and its control, if any), else the icon there."""
    for window in reversed(desktop.windows):
        if window.rect.contains(x, y):
            control = next((w for w in widgets(desktop, window) if w.role != "label" and w.rect.contains(x, y)), None)
            return window, control, None
    icon = next((app for app, cell in desktop.icons if cell.contains(x, y)), None)
    return None, None, icon


def step(desktop: Desktop, action: Action) -> Desktop:
    """The desktop after `action`; `event` says what happened (an action that does nothing says why)."""
    d = replace(desktop, steps=desktop.steps + 1)
    if isinstance(action, TypeText):
        return _type(d, action.text)
    x, y = action.x, action.y
    if not (0 <= x < WIDTH and 0 <= y < HEIGHT):
        return replace(d, event=f"({x}, {y}) is outside the {WIDTH}x{HEIGHT} screen; nothing happened.")
    window, control, icon = hit(d, x, y)
    dialog = d.window("update")
    if dialog is not None and window is not dialog:
        return replace(d, event=f"Clicked ({x}, {y}): the Update available dialog blocks the rest of the screen.")
    if window is None:
        d = replace(d, focused=None)
        if icon is None:
            return replace(d, event=f"Clicked ({x}, {y}) on the empty desktop.")
        return _open(d, icon)
    d = _raise(d, window)
    name = control.name if control is not None else None
    title = TITLES[window.kind]
    if control is None:
        return replace(d, focused=None, event=f"Clicked ({x}, {y}) inside the {title} window.")
    if control.role == "close" or name in ("update.later", "update.install"):
        return _close(d, window, f"Clicked {control.label or 'x'!r}: the {title} window closed.")
    if name == "notes.text":
        return replace(d, focused=name, event="Clicked the note's text field: it has the focus.")
    d = replace(d, focused=None)
    if name == "notes.clear":
        return replace(d, text="", status="", event="Clicked Clear: the note is empty.")
    assert name == "notes.save", name
    if not d.text:
        return replace(d, status="Nothing to save.", event="Clicked Save: the note is empty, nothing was saved.")
    saved = (*d.saved, d.text)
    return replace(d, saved=saved, status=f"Saved note{len(saved)}.txt",
                   event=f"Clicked Save: saved note{len(saved)}.txt ({d.text!r}).")


def _type(d: Desktop, text: str) -> Desktop:
    if d.focused is None:
        return replace(d, event="Typed, but no text field has the focus: nothing changed.")
    kept = "".join(ch for ch in text if " " <= ch <= "~")
    room = MAX_TEXT - len(d.text)
    new = d.text + kept[:room]
    cut = " (the field is full: the rest was dropped)" if len(kept) > room else ""
    return replace(d, text=new, status="", event=f"Typed {kept[:room]!r}: the note reads {new!r}{cut}.")


def _raise(d: Desktop, window: Window) -> Desktop:
    if d.top is window:
        return d
    return replace(d, windows=(*(w for w in d.windows if w is not window), window))


def _open(d: Desktop, app: Kind) -> Desktop:
    title = TITLES[app]
    existing = d.window(app)
    if existing is not None:
        return replace(_raise(d, existing), event=f"Clicked the {title} icon: its window came to the front.")
    x, y = next((x, y) for kind, x, y in d.spawn if kind == app)
    return replace(d, windows=(*d.windows, Window(app, x, y)), event=f"Clicked the {title} icon: {title} opened.")


def _close(d: Desktop, window: Window, event: str) -> Desktop:
    d = replace(d, windows=tuple(w for w in d.windows if w is not window), event=event)
    if window.kind == "notes":  # an unsaved note is lost with its window
        d = replace(d, text="", status="", focused=None)
    return d


def reward(desktop: Desktop) -> float:
    """1.0 once a saved note is exactly the goal's word, else 0.0: read from the state, never from pixels."""
    return 1.0 if desktop.word in desktop.saved else 0.0


def expert_action(desktop: Desktop) -> Action | None:
    """The next action of a shortest-minded solver of the goal; None once it is reached.

    Dismiss the dialog, close whatever sits in front of Notes (or over its icon), open Notes, clear a wrong note,
    focus the field, type what is missing, press Save. Every click it returns lands on the control it aims at."""
    if reward(desktop) == 1.0:
        return None
    dialog = desktop.window("update")
    if dialog is not None:
        return Click(*_control(desktop, dialog, "update.later").rect.center)
    notes = desktop.window("notes")
    if notes is None:
        cell = next(cell for app, cell in desktop.icons if app == "notes")
        cx, cy = cell.center
        front, _, _ = hit(desktop, cx, cy)
        if front is not None:  # a window covers the icon: close the front one (its close box is visible)
            return _close_click(desktop)
        return Click(cx, cy)
    if desktop.top is not notes:
        return _close_click(desktop)
    if desktop.text != desktop.word and not desktop.word.startswith(desktop.text):
        return Click(*_control(desktop, notes, "notes.clear").rect.center)
    if desktop.text != desktop.word:
        if desktop.focused != "notes.text":
            return Click(*_control(desktop, notes, "notes.text").rect.center)
        return TypeText(desktop.word[len(desktop.text):])
    return Click(*_control(desktop, notes, "notes.save").rect.center)


def _control(desktop: Desktop, window: Window, name: str) -> Widget:
    return next(w for w in widgets(desktop, window) if w.name == name)


def _close_click(desktop: Desktop) -> Click:
    top = desktop.top
    assert top is not None
    return Click(*_control(desktop, top, f"{top.kind}.close").rect.center)


def describe(desktop: Desktop) -> str:
    """The screen as text, front to back (an accessibility tree of sorts): for logs and for text-only models."""
    lines = [f"Screen {WIDTH}x{HEIGHT}."]
    for window in reversed(desktop.windows):
        r = window.rect
        lines.append(f"Window {TITLES[window.kind]!r} at ({r.x}, {r.y}) size {r.w}x{r.h}:")
        for w in widgets(desktop, window):
            focus = " (focused)" if desktop.focused == w.name else ""
            lines.append(f"  {w.role} {w.label!r} at ({w.rect.x}, {w.rect.y}) size {w.rect.w}x{w.rect.h}{focus}")
    for app, cell in desktop.icons:
        lines.append(f"Icon {TITLES[app]!r} at ({cell.x}, {cell.y}) size {cell.w}x{cell.h}")
    return "\n".join(lines)


# -- rendering ----------------------------------------------------------------------------------------------------

_FONT = ImageFont.load_default_imagefont()  # a bitmap font inside Pillow: the same pixels everywhere
_BACKGROUND = (38, 110, 120)
_TASKBAR = (30, 30, 40)
_FACE = (222, 222, 222)
_EDGE = (70, 70, 70)
_TITLE_ACTIVE = (40, 80, 170)
_TITLE_INACTIVE = (128, 128, 140)
_DIALOG_TITLE = (170, 60, 40)


def render(desktop: Desktop) -> Image.Image:
    """The screen as an RGB image of WIDTH x HEIGHT."""
    image = Image.new("RGB", (WIDTH, HEIGHT), _BACKGROUND)
    draw = ImageDraw.Draw(image)
    for app, cell in desktop.icons:
        left = cell.x + (cell.w - ICON) // 2
        draw.rectangle((left, cell.y + 2, left + ICON - 1, cell.y + 1 + ICON), fill=ICON_COLORS[app], outline=_EDGE)
        draw.text((left + 9, cell.y + 8), TITLES[app][0], fill=(20, 20, 20), font=_FONT)
        _centered(draw, TITLES[app], cell.x, cell.y + ICON + 4, cell.w, fill=(255, 255, 255))
    for window in desktop.windows:
        _draw_window(draw, desktop, window, active=window is desktop.top)
    top = HEIGHT - TASKBAR_HEIGHT
    draw.rectangle((0, top, WIDTH - 1, HEIGHT - 1), fill=_TASKBAR)
    draw.text((4, top + 3), "Start", fill=(255, 255, 255), font=_FONT)
    x = 44
    for window in desktop.windows:
        if window.kind != "update":
            draw.text((x, top + 3), TITLES[window.kind], fill=(200, 200, 200), font=_FONT)
            x += 44
    return image


def _centered(draw: ImageDraw.ImageDraw, text: str, x: int, y: int, w: int, fill: tuple[int, int, int]) -> None:
    width = int(draw.textlength(text, font=_FONT))
    draw.text((x + (w - width) // 2, y), text, fill=fill, font=_FONT)


def _draw_window(draw: ImageDraw.ImageDraw, desktop: Desktop, window: Window, active: bool) -> None:
    r = window.rect
    draw.rectangle((r.x, r.y, r.x + r.w - 1, r.y + r.h - 1), fill=_FACE, outline=_EDGE)
    title = _DIALOG_TITLE if window.kind == "update" else _TITLE_ACTIVE if active else _TITLE_INACTIVE
    draw.rectangle((r.x + 1, r.y + 1, r.x + r.w - 2, r.y + TITLE_HEIGHT - 1), fill=title)
    draw.text((r.x + 4, r.y + 2), TITLES[window.kind], fill=(255, 255, 255), font=_FONT)
    for w in widgets(desktop, window):
        b = w.rect
        box = (b.x, b.y, b.x + b.w - 1, b.y + b.h - 1)
        if w.role == "close":
            draw.rectangle(box, fill=(200, 70, 60), outline=(255, 255, 255))
            _centered(draw, "x", b.x, b.y, b.w, fill=(255, 255, 255))
        elif w.role == "button":
            draw.rectangle(box, fill=(240, 240, 240), outline=_EDGE)
            _centered(draw, w.label, b.x, b.y + 4, b.w, fill=(0, 0, 0))
        elif w.role == "textfield":
            focused = desktop.focused == w.name
            draw.rectangle(box, fill=(255, 255, 255), outline=(40, 80, 200) if focused else _EDGE,
                           width=2 if focused else 1)
            shown = w.label + ("|" if focused else "")
            draw.text((b.x + 4, b.y + 4), shown, fill=(0, 0, 0), font=_FONT)
        elif w.label:
            draw.text((b.x, b.y), w.label, fill=(30, 30, 30), font=_FONT)


def screenshot_png(desktop: Desktop) -> bytes:
    """The screen as PNG bytes (fixed encoder settings: the same state gives the same bytes with the same zlib)."""
    buffer = io.BytesIO()
    render(desktop).save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()
