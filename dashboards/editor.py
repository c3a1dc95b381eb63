"""The create / edit / delete part of the SLOs, rules and backends pages: one editor, told by a `Crud` what it edits.

It draws the "Edit" header (and the read-only note for a viewer), then two tabs: a create form, which starts
empty again after each success, and an edit form for the resource picked by name, opened with its ETag (so a
change someone made meanwhile is refused), with a reload button and a confirmed delete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import streamlit as st

from dashboards import session
from dashboards.api import SpillwayApi
from dashboards.forms import Build

# A form (`forms.slo_form`): its key, the resource being edited (None: a new one), whether it is disabled, then
# what `Crud.form_args` read; it returns what builds the request body when submitted.
Form = Callable[..., Build | None]


@dataclass(frozen=True)
class Opened:
    """The resource open in the edit tab, for a `Crud.before_form` hook that draws controls of its own."""

    api: SpillwayApi
    ident: str
    name: str
    current: dict[str, Any]
    etag: str | None
    key: str  # the edit form's key: submit with it so its messages land on that form
    disabled: bool


@dataclass(frozen=True)
class Crud:
    """What the editor edits, and every word and widget key it shows for it."""

    kind: str  # the API's collection: "slos"
    prefix: str  # widget keys: "slo" -> "slo-create", "slo_edit_pick", "slo-edit-{id}-{version}", "slo-delete-{id}"
    noun: str  # in the picker's label and the messages: "SLO" -> "SLO {name} saved."
    create_tab: str
    edit_tab: str
    created: str  # the message after a create: "SLO created."
    empty: str  # the edit tab with nothing to edit: "No SLOs to edit."
    delete_button: str  # "Delete SLO"
    form: Form
    # Extra arguments of `form`, read from the API after the list (the rule form's SLO names).
    form_args: Callable[[SpillwayApi], tuple[Any, ...]] = lambda api: ()
    edit_first: bool = False  # the edit tab left of the create tab
    before_form: Callable[[Opened], None] | None = None  # drawn in the edit tab above the edit form


def crud(spec: Crud) -> bool:
    """Draw the editor; False when there was nothing to edit (the edit tab says so and the page may end there)."""
    api = session.api()
    disabled = not session.can_edit()
    st.header("Edit")
    session.read_only_note()
    items = api.list_all(spec.kind)
    args = spec.form_args(api)
    first, second = st.tabs([spec.edit_tab, spec.create_tab] if spec.edit_first else [spec.create_tab, spec.edit_tab])
    create, edit = (second, first) if spec.edit_first else (first, second)
    with create:
        _create(spec, api, disabled, args)
    with edit:
        if not items:
            st.caption(spec.empty)
            return False
        _edit(spec, api, disabled, args, items)
    return True


def _create(spec: Crud, api: SpillwayApi, disabled: bool, args: tuple[Any, ...]) -> None:
    base = f"{spec.prefix}-create"
    key = session.fresh_key(base)
    build = spec.form(key, None, disabled, *args)
    if build is not None:
        session.submit(key, lambda: api.create(spec.kind, build()), spec.created, reset=base)


def _edit(spec: Crud, api: SpillwayApi, disabled: bool, args: tuple[Any, ...], items: list[dict[str, Any]]) -> None:
    by_name = {item["name"]: item for item in items}
    name = st.selectbox(spec.noun, sorted(by_name), key=f"{spec.prefix}_edit_pick")
    ident = by_name[name]["id"]
    current, etag = session.opened(spec.kind, ident)
    key = f"{spec.prefix}-edit-{ident}-{current['version']}"
    edited = (spec.kind, ident)
    if spec.before_form is not None:
        spec.before_form(Opened(api, ident, name, current, etag, key, disabled))
    build = spec.form(key, current, disabled, *args)
    if build is not None:
        session.submit(key, lambda: api.patch(spec.kind, ident, build(), etag), f"{spec.noun} {name} saved.",
                       edited=edited)  # fmt: skip
    session.reload_button(spec.kind, ident, key, by_name[name]["version"])
    sure = st.checkbox(f"Yes, delete {name}", key=f"{spec.prefix}-delete-sure-{ident}", disabled=disabled)
    if st.button(spec.delete_button, disabled=disabled or not sure, key=f"{spec.prefix}-delete-{ident}"):
        session.submit(key, lambda: api.delete(spec.kind, ident, etag), f"{spec.noun} {name} deleted.",
                       edited=edited)  # fmt: skip
