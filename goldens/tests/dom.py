"""A parsed HTML page as a tree of elements, for tests that query a report's hooks (tag, class,
attributes) the way a browser's selectors would: the report as rendered by report.py, and as a
browser serialized it after loading (test_report_browser)."""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


@dataclasses.dataclass(eq=False)
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = dataclasses.field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    @property
    def text(self) -> str:
        """Every text inside, children included, in document order."""
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def select(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Element]:
        """Descendants in document order with this tag, class and attributes (`data_step="3"`
        matches `data-step="3"`)."""
        wanted = {name.replace("_", "-"): value for name, value in attrs.items()}
        found = []
        for child in self.children:
            if isinstance(child, str):
                continue
            if (
                (tag is None or child.tag == tag)
                and (cls is None or cls in child.classes)
                and all(child.attrs.get(name) == value for name, value in wanted.items())
            ):
                found.append(child)
            found += child.select(tag, cls, **attrs)
        return found

    def one(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Element:
        (found,) = self.select(tag, cls, **attrs)
        return found


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.open = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {name: value or "" for name, value in attrs})
        self.open[-1].children.append(element)
        if tag not in VOID:
            self.open.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.open.pop()

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.open) - 1, 0, -1):
            if self.open[depth].tag == tag:
                del self.open[depth:]
                return

    def handle_data(self, data: str) -> None:
        self.open[-1].children.append(data)


def parse(page: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(page)
    builder.close()
    return builder.root
