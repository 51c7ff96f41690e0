"""The README's plugin example is exactly examples/slot_plugin.py (which a test runs), and it is short."""

from __future__ import annotations

import re

from tests.support.procs import ROOT


def sdk_section() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- sdk:begin -->(.*?)<!-- sdk:end -->", text, re.S)
    assert match, "README lacks the sdk markers"
    return match.group(1)


def test_readme_example_is_the_tested_file():
    blocks = re.findall(r"```python\n(.*?)```", sdk_section(), re.S)
    assert blocks, "no python block in the README's SDK section"
    example = (ROOT / "examples" / "slot_plugin.py").read_text()
    assert blocks[0] == example
    assert len(example.splitlines()) <= 26  # 25, and a line to set up logging
