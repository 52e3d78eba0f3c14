"""The GUI example's toy desktop (examples/gui_agent/desktop.py): its rules, its reward, its expert, and a renderer
that draws the same pixels for the same state and draws each control where a click finds it; plus the agent's
pure parts (reading tool calls, the sim directive, the placeholder runs)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from examples.gui_agent import desktop as gui
from examples.gui_agent.agent import directive, pad_runs, parse_action
from examples.gui_agent.desktop import Click, Desktop, TypeText


def center(d: Desktop, name: str) -> Click:
    window = next(w for w in d.windows if name.startswith(w.kind + "."))
    return Click(*next(w for w in gui.widgets(d, window) if w.name == name).rect.center)


def icon(d: Desktop, app: str) -> Click:
    return Click(*next(cell for a, cell in d.icons if a == app).center)


def plain(seed: int) -> Desktop:
    """Task `seed` without the windows it starts with (no dialog, no Files window)."""
    return replace(gui.new_desktop(seed), windows=())


def notes_focused(seed: int = 0) -> Desktop:
    d = gui.step(plain(seed), icon(plain(seed), "notes"))
    return gui.step(d, center(d, "notes.text"))


# -- the goal and its reward --------------------------------------------------------------------------------------

def expert_path(d: Desktop, limit: int = 12) -> list[Desktop]:
    """Every state the expert passes through, the start included."""
    path = [d]
    while (action := gui.expert_action(path[-1])) is not None:
        path.append(gui.step(path[-1], action))
        assert len(path) <= limit + 1, f"the expert did not finish in {limit} actions: {path[-1].event}"
    return path


def test_every_seed_is_solvable_and_only_the_save_pays() -> None:
    lengths = set()
    for seed in range(300):
        d = gui.new_desktop(seed)
        assert d.word in d.instruction
        path = expert_path(d)
        assert [gui.reward(s) for s in path] == [0.0] * (len(path) - 1) + [1.0]
        assert path[-1].saved == (d.word,) and path[-1].event.startswith("Clicked Save")
        lengths.add(len(path) - 1)
    assert lengths == {4, 5, 6}  # open, focus, type, save; plus the dialog and a Files window over the icon


def test_new_desktop_is_a_function_of_the_seed() -> None:
    assert gui.new_desktop(7) == gui.new_desktop(7)
    assert len({(gui.new_desktop(s).word, gui.new_desktop(s).icons) for s in range(50)}) == 50
    assert {len(gui.new_desktop(s).windows) for s in range(50)} == {0, 1, 2}


random_actions = st.one_of(
    st.builds(Click, st.integers(-5, gui.WIDTH + 5), st.integers(-5, gui.HEIGHT + 5)),
    st.builds(TypeText, st.text(max_size=10)),
)


@given(seed=st.integers(0, 10_000), data=st.data())
def test_the_expert_finishes_from_any_reachable_state(seed: int, data: st.DataObject) -> None:
    """Random actions, half of them clicks on what the screen shows (a control or an icon, so the prefix reaches
    typed, wrong, saved and closed notes), then the expert from wherever they left the desktop."""
    d = gui.new_desktop(seed)
    for i in range(data.draw(st.integers(0, 25), label="actions")):
        targets = [w.rect.center for win in d.windows for w in gui.widgets(d, win)] + [c.center for _, c in d.icons]
        on_screen = st.sampled_from(targets).map(lambda point: Click(*point))
        d = gui.step(d, data.draw(st.one_of(random_actions, on_screen, st.builds(TypeText, st.sampled_from(
            [d.word, d.word[:2], "x"]))), label=f"action {i}"))
        assert d.steps == i + 1 and d.event
        assert len(d.text) <= gui.MAX_TEXT and all(" " <= ch <= "~" for ch in d.text)
        assert [w.kind for w in d.windows].count("update") <= 1
        assert d.window("update") in (None, d.top)  # the dialog is always in front
        assert d.focused is None or (d.window("notes") is not None and d.top == d.window("notes"))
        assert d.window("notes") is not None or (d.text == "" and d.status == "")
    assert gui.reward(expert_path(d)[-1]) == 1.0


def test_a_wrong_note_does_not_pay_and_clear_starts_over() -> None:
    d = gui.step(notes_focused(), TypeText("wrong"))
    d = gui.step(d, center(d, "notes.save"))
    assert d.saved == ("wrong",) and gui.reward(d) == 0.0 and d.status == "Saved note1.txt"
    assert isinstance(gui.expert_action(d), Click) and gui.step(d, gui.expert_action(d)).text == ""  # Clear
    assert expert_path(d)[-1].saved == ("wrong", d.word)


# -- the rules ----------------------------------------------------------------------------------------------------

def test_an_icon_opens_its_window_where_the_task_says_and_a_second_click_raises_it() -> None:
    def clear_of_windows(d: Desktop) -> bool:  # neither app's window covers either icon
        windows = [gui.Window(kind, x, y) for kind, x, y in d.spawn if kind in ("notes", "files")]
        return not any(w.rect.contains(icon(d, app).x, icon(d, app).y) for w in windows for app in ("notes", "files"))

    d = next(plain(s) for s in range(200) if clear_of_windows(plain(s)))
    d = gui.step(d, icon(d, "notes"))
    spawn = next((x, y) for kind, x, y in d.spawn if kind == "notes")
    assert [(w.kind, w.x, w.y) for w in d.windows] == [("notes", *spawn)]
    assert d.event == "Clicked the Notes icon: Notes opened."
    d = gui.step(d, icon(d, "files"))
    assert [w.kind for w in d.windows] == ["notes", "files"]
    d = gui.step(d, icon(d, "notes"))
    assert [w.kind for w in d.windows] == ["files", "notes"] and "came to the front" in d.event


def test_the_dialog_blocks_everything_else_until_dismissed() -> None:
    seed = next(s for s in range(100) if gui.new_desktop(s).window("update") is not None)
    d = gui.new_desktop(seed)
    blocked = gui.step(d, icon(d, "notes"))
    assert blocked.windows == d.windows and "blocks" in blocked.event
    for button in ("update.later", "update.install"):
        gone = gui.step(d, center(d, button))
        assert gone.windows == tuple(w for w in d.windows if w.kind != "update")


def test_typing_needs_the_focus_and_keeps_printable_ascii_up_to_the_limit() -> None:
    d = gui.step(plain(0), icon(plain(0), "notes"))
    unfocused = gui.step(d, TypeText("abc"))
    assert unfocused.text == "" and "no text field has the focus" in unfocused.event
    f = gui.step(d, center(d, "notes.text"))
    assert f.focused == "notes.text"
    typed = gui.step(f, TypeText("a\tb\né c"))
    assert typed.text == "ab c"
    full = gui.step(typed, TypeText("x" * 40))
    assert len(full.text) == gui.MAX_TEXT and "full" in full.event
    blurred = gui.step(typed, center(typed, "notes.save"))
    assert blurred.focused is None and gui.step(blurred, TypeText("z")).text == "ab c"


def test_closing_notes_loses_the_unsaved_note_and_an_empty_note_is_not_saved() -> None:
    d = gui.step(notes_focused(), TypeText("draft"))
    closed = gui.step(d, center(d, "notes.close"))
    assert closed.window("notes") is None and closed.text == "" and closed.focused is None
    reopened = gui.step(closed, icon(closed, "notes"))
    assert reopened.text == ""
    empty = gui.step(reopened, center(reopened, "notes.save"))
    assert empty.saved == () and empty.status == "Nothing to save."


def test_a_click_lands_on_the_front_window_and_raises_it() -> None:
    d = replace(plain(5), windows=(gui.Window("notes", 10, 10), gui.Window("files", 100, 60)))
    for x in range(0, gui.WIDTH, 5):
        for y in range(0, gui.HEIGHT, 5):
            fronts = [w for w in d.windows if w.rect.contains(x, y)]
            assert gui.hit(d, x, y)[0] == (fronts[-1] if fronts else None)
    assert gui.hit(d, 120, 80)[0] == d.windows[1]  # both windows are there: Files is in front
    raised = gui.step(d, Click(20, 100))  # only Notes is there
    assert [w.kind for w in raised.windows] == ["files", "notes"] and gui.hit(raised, 120, 80)[0] == raised.top


def test_clicks_off_the_screen_or_on_the_desktop_change_nothing_but_the_focus() -> None:
    d = notes_focused()
    off = gui.step(d, Click(gui.WIDTH, 10))
    assert "outside" in off.event and off.focused == d.focused and off.windows == d.windows
    empty = next((x, y) for x in range(gui.WIDTH) for y in range(gui.HEIGHT - gui.TASKBAR_HEIGHT)
                 if gui.hit(d, x, y) == (None, None, None))
    bare = gui.step(d, Click(*empty))
    assert bare.focused is None and bare.windows == d.windows and bare.steps == d.steps + 1


def test_step_never_changes_its_input() -> None:
    d = gui.new_desktop(11)
    snapshot = replace(d)
    for _ in range(6):
        action = gui.expert_action(d)
        if action is None:
            break
        gui.step(d, action)
        assert d == snapshot and d.event == snapshot.event
        d = gui.step(d, action)
        snapshot = replace(d)


# -- rendering ----------------------------------------------------------------------------------------------------

def pixels(d: Desktop) -> bytes:
    return gui.render(d).tobytes()


def test_the_same_state_draws_the_same_pixels_and_png_bytes() -> None:
    for seed in range(20):
        d = gui.new_desktop(seed)
        twin = gui.new_desktop(seed)
        assert pixels(d) == pixels(twin) and gui.screenshot_png(d) == gui.screenshot_png(twin)
        image = Image.open(io.BytesIO(gui.screenshot_png(d)))
        assert image.format == "PNG" and image.size == (gui.WIDTH, gui.HEIGHT) and image.mode == "RGB"
        assert image.tobytes() == pixels(d)
        assert len(gui.screenshot_png(d)) < 16_000  # a small screenshot, a handful of image tokens


def test_what_the_state_holds_is_what_the_screen_shows() -> None:
    d = notes_focused()
    typed = gui.step(d, TypeText("amber"))
    assert pixels(typed) != pixels(d)  # the text is drawn
    blurred = gui.step(typed, center(typed, "notes.clear"))
    assert pixels(blurred) != pixels(replace(blurred, focused="notes.text"))  # focus ring and caret
    assert pixels(d) == pixels(replace(d, event="anything else"))  # the event is words, not pixels


def test_controls_are_drawn_where_a_click_finds_them() -> None:
    colours = {"close": (200, 70, 60), "button": (240, 240, 240), "textfield": (255, 255, 255)}
    seen = set()
    for seed in range(30):
        for d in expert_path(gui.new_desktop(seed)):
            image = gui.render(d)
            for window in d.windows:
                for w in gui.widgets(d, window):
                    corner = (w.rect.x + 1 + (w.role == "textfield"), w.rect.y + 1 + (w.role == "textfield"))
                    if w.role == "label" or {gui.hit(d, *corner)[1], gui.hit(d, *w.rect.center)[1]} != {w}:
                        continue  # text, or covered by a window in front
                    assert image.getpixel(corner) == colours[w.role], (seed, w.name)
                    seen.add(w.name)
    assert {"notes.text", "notes.save", "notes.clear", "notes.close", "update.later", "files.close"} <= seen


# -- the agent's pure parts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("click", '{"x": 10, "y": 20}', Click(10, 20)),
    ("click", {"x": "10", "y": 20.0}, Click(10, 20)),
    ("type", '{"text": "amber"}', TypeText("amber")),
    ("click", '{"x": 10}', "error: click needs integer arguments x and y"),
    ("click", "{not json", "error: the arguments are not JSON (Expecting property name enclosed in double quotes)"),
    ("type", "[1]", "error: the arguments must be a JSON object"),
    ("type", '{"text": 5}', "error: type needs a string argument text"),
    ("scroll", "{}", "error: unknown tool 'scroll'; the tools are click and type"),
])
def test_tool_calls_become_actions_or_an_error_for_the_model(name: str, arguments: object, expected: object) -> None:
    assert parse_action(name, arguments) == expected


def test_the_directive_scripts_the_experts_next_action() -> None:
    from sglang_sim.directives import read

    d = gui.new_desktop(4)
    while (action := gui.expert_action(d)) is not None:
        ((name, args),) = read(directive(d)).tool_calls
        assert parse_action(name, args) == action
        d = gui.step(d, action)
    assert read(directive(d)).reply == f"Done: the note {d.word} is saved."


def test_pad_runs_finds_each_image_placeholder_run() -> None:
    assert pad_runs([1, 9, 9, 9, 2, 9, 3, 9, 9], 9) == [(1, 3), (5, 1), (7, 2)]
    assert pad_runs([], 9) == [] and pad_runs([1, 2], 9) == []
