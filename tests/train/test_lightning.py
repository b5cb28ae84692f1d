"""zstore.lightning under a real Lightning Trainer: 2 CPU ranks (ddp_spawn), 3 epochs."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from conftest import PYTHON, run_or_dump, subprocess_env

import zstore

#: Each script's ranks end their process group at exit (``end_group``): Lightning does so
#: for NCCL, not for gloo, and torch then tears gloo's threads down during interpreter
#: finalization, where a rank now and then died of SIGABRT as it exited ("terminate
#: called without an active exception": 1 run in ~30 here; pytorch/pytorch#190489).
#: Users of gloo should do the same (README, Lightning).
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import lightning.pytorch as pl
    import torch
    from zstore.lightning import WindowDataModule

    import atexit
    import torch.distributed as dist

    @atexit.register
    def end_group():  # each rank's gloo group ended at its exit: see the note above SCRIPT
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    class Recorder(pl.LightningModule):
        def __init__(self, out):
            super().__init__()
            self.out, self.seen = out, []
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, i):
            for item, start in zip(batch["item"], batch["start"].tolist()):
                self.seen.append([self.current_epoch, item, start])
            return (self.w * batch["wav"].mean()).sum()

        def on_train_end(self):
            with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
                json.dump(self.seen, f)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":
        store, out, loader = sys.argv[1:4]
        dm = WindowDataModule(store, window_seconds=1.0, batch_size=2, seed=3,
                              windows_per_item=2, loader=loader, num_workers=1,
                              cache=None)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=3,
                             use_distributed_sampler=False, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(Recorder(out), datamodule=dm)
""")


@pytest.mark.parametrize("loader", ["zstore", "torch"])
def test_trainer_gets_new_windows_every_epoch(small_store, tmp_path, loader):
    pytest.importorskip("lightning")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = subprocess_env()
    env.update(
        ZSTORE_RAM_DIR=str(tmp_path / "ram"),
        ZSTORE_RAM_BYTES="64MB",
        ZSTORE_SSD_DIR="none",
        OMP_NUM_THREADS="1",
    )
    proc = run_or_dump(
        [PYTHON, str(script), small_store, str(tmp_path), loader],
        env,
        timeout=300,
        stacks=tmp_path / "stacks",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, windows_per_item=2)
    per_epoch = [sorted(tuple(x[1:]) for rank in seen for x in rank if x[0] == e) for e in range(3)]
    assert all(len(e) == len(ds) for e in per_epoch)  # 2 ranks cover every window
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]  # the windows move every epoch


def test_no_validation_loader_without_a_validation_store(small_store):
    pytest.importorskip("lightning")
    from zstore.lightning import WindowDataModule

    dm = WindowDataModule(small_store, window_seconds=1.0)
    assert dm.val_dataloader is None
    with pytest.raises(zstore.ConfigError, match="no batch"):
        WindowDataModule(small_store, window_seconds=1.0, batch_size=64).train_dataloader()


RESUME = textwrap.dedent("""
    import json, os, sys
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from zstore.lightning import WindowDataModule

    import atexit
    import torch.distributed as dist

    @atexit.register
    def end_group():  # each rank's gloo group ended at its exit: see the note above SCRIPT
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    class Recorder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.seen = []
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, i):
            for item, start in zip(batch["item"], batch["start"].tolist()):
                self.seen.append([self.current_epoch, item, start])
            return (self.w * batch["wav"].mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":
        store, out, loader, epochs, ckpt = sys.argv[1:6]
        dm = WindowDataModule(store, window_seconds=1.0, batch_size=2, seed=3,
                              windows_per_item=3, loader=loader, num_workers=1, cache=None)
        saver = ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1,
                                every_n_epochs=1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=int(epochs),
                             use_distributed_sampler=False, logger=False,
                             callbacks=[saver], enable_progress_bar=False,
                             enable_model_summary=False)
        model = Recorder()
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt if ckpt != "-" else None)
        with open(os.path.join(out, "seen.json"), "w") as f:
            json.dump(model.seen, f)
""")


@pytest.mark.parametrize("loader", ["zstore", "torch"])
def test_a_resumed_run_draws_the_windows_of_the_epoch_it_resumes_into(
    small_store, tmp_path, loader
):
    pytest.importorskip("lightning")
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    env = subprocess_env()
    env.update(OMP_NUM_THREADS="1")

    def fit(out, epochs, ckpt="-"):
        out.mkdir()
        proc = run_or_dump(
            [PYTHON, str(script), small_store, str(out), loader, str(epochs), str(ckpt)],
            env,
            timeout=300,
            stacks=out / "stacks",
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((out / "seen.json").read_text())

    straight = fit(tmp_path / "straight", 2)  # epochs 0 and 1 in one run
    resumed = fit(tmp_path / "resumed", 2, tmp_path / "straight" / "epoch=0.ckpt")
    epoch1 = [x for x in straight if x[0] == 1]
    assert resumed and all(x[0] == 1 for x in resumed)
    assert resumed == epoch1  # the same windows in the same order
    assert sorted(map(tuple, epoch1)) != sorted((1, *x[1:]) for x in straight if x[0] == 0)


def test_importing_zstore_does_not_import_lightning():
    """Lightning takes seconds to import; every DataLoader worker and rank imports zstore."""
    code = "import sys, zstore; sys.exit('lightning' in sys.modules or 'pytorch_lightning' in sys.modules)"
    proc = subprocess.run(
        [PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
