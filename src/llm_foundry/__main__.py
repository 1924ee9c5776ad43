import sys

from torch.distributed.elastic.multiprocessing.errors import record

from llm_foundry.cli import main

if __name__ == "__main__":
    # under torchrun, @record hands a failing rank's traceback to the launcher's report
    sys.exit(record(main)())
