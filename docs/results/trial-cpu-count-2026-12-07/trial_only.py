"""Trial-only check: the start-up trial's record for AlexNet-BN's gradients, one rank a host."""
import json
import sys

import torch
from mpi4py import MPI

from hpcdl.models import create_model
from hpcdl.train.config import CommConfig
from hpcdl.train.session import open_communicator

torch.set_num_threads(1)
with torch.device("meta"):
    model = create_model("alexnet_bn", num_classes=1000)
numels = [p.numel() for p in model.parameters() if p.requires_grad]
comm = open_communicator(CommConfig(backend="auto", bucket_mb=25, trial_s=3), MPI.COMM_WORLD,
                         gradients=numels)
if MPI.COMM_WORLD.rank == 0:
    rec = comm.trial.record()
    print(json.dumps(rec["chosen"]), "spent", rec["spent_s"], "sample", rec["sample_mb"])
    for c in rec["candidates"]:
        print(f"  {c['backend']:5s} {c['bucket_mb']:5g}/{c['first_bucket_mb']:g} "
              f"score {c['seconds']:.3f} cpu {c['transport_cpu_s']:.3f} spread {c['spread']:.3f}")
    with open(sys.argv[1], "w") as f:
        json.dump(rec, f, indent=1)
comm.close()
