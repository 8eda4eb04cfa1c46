"""Tables: pandas ``to_html(escape=True)``, wrapped as safe markup for the template."""

from __future__ import annotations

from typing import Any


def table_block(caption: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import pandas as pd
    from markupsafe import Markup

    frame = pd.DataFrame(rows)
    html = frame.to_html(escape=True, index=False, float_format=lambda x: f"{x:.4g}", border=0)
    return {"kind": "table", "caption": caption, "html": Markup(html)}  # escaped by pandas
