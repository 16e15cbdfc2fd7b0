"""Screenshot a saved plan's HTML report with headless Chromium (the README's picture).

    .venv/bin/shardplan plan examples/llama_demo.py --mesh dp=2,tp=4 --out plan.json
    .venv/bin/python scripts/report_screenshot.py plan.json docs/report.png [--height 1250]

Needs `chromium` (``scripts/install_browser.sh``). The page is written next to the PNG's
temporary folder and removed; only the PNG stays.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import shardplan as sp


def screenshot(plan_file: Path, png: Path, width: int = 1400, height: int = 1250) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("report_screenshot: no chromium; run scripts/install_browser.sh as root")
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "plan.html"
        sp.load_plan(plan_file).to_html(page)
        command = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={folder}/profile", f"--window-size={width},{height}",
            f"--screenshot={png.resolve()}", page.as_uri(),
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan_file", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--height", type=int, default=1250)
    args = parser.parse_args()
    screenshot(args.plan_file, args.png, height=args.height)


if __name__ == "__main__":
    main()
