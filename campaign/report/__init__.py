"""Presentation: one table model and its renderers (text, Markdown, CSV, HTML, plots). Only formats."""
