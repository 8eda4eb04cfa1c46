"""The report's Jinja2 template (autoescaping on; tables arrive pre-escaped from pandas)."""

from __future__ import annotations

from typing import Any

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{ title }}</title>
<style>
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { border-bottom: 2px solid #444; }
h2 { margin-top: 2em; border-bottom: 1px solid #aaa; }
table.dataframe { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
table.dataframe th, table.dataframe td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
table.dataframe th { background: #eee; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; }
p.note { color: #555; font-style: italic; }
code { background: #f3f3f3; padding: 0 3px; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<p class="note">Generated {{ generated }} from {{ sources | join(", ") }}.</p>
{% for section in sections %}
<section class="report-section" id="{{ section.id }}">
<h2>{{ section.title }}</h2>
{% for block in section.blocks %}
{% if block.kind == "text" %}<p>{{ block.text }}</p>
{% elif block.kind == "note" %}<p class="note">{{ block.text }}</p>
{% elif block.kind == "code" %}<p><code>{{ block.text }}</code></p>
{% elif block.kind == "table" %}<h3>{{ block.caption }}</h3>
{{ block.html }}
{% elif block.kind == "figure" %}<figure class="report-figure" id="{{ block.id }}">
<img alt="{{ block.caption }}" src="{{ block.uri }}">
<figcaption>{{ block.caption }}</figcaption>
</figure>
{% endif %}
{% endfor %}
</section>
{% endfor %}
</body>
</html>
"""


def render(context: dict[str, Any]) -> str:
    from jinja2 import Environment

    env = Environment(autoescape=True)
    return env.from_string(PAGE).render(**context)
