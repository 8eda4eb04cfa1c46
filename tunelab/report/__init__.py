"""One self-contained HTML file from tuning runs and benchmark results (the ``tunelab report`` command
is ``tunelab.cli.report``).

Figures are PNG data URIs (matplotlib, Agg), tables are pandas HTML, the page is a Jinja2
template with autoescaping on.  Nothing heavy is imported until a report is built.
"""
