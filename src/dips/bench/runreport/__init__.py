"""``dips report``: an HTML page with plots of a run directory or a comparison output.

:func:`dips.bench.runreport.build.write_report` is the entry point; the command is
:func:`dips.bench.runreport.cli.report`.  Reads only files (nothing from the roles or the wire).
"""
