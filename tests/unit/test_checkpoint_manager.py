"""`rayhpc.engine.checkpoint.save` and `load`, the one writer and reader of every job's checkpoint folder, in
one process: the model and optimizer state, the RNG, the runner's extra state and the progress come back as
they were, and the progress file is written last (a folder cut short before it is never loaded)."""

import torch

from rayhpc.engine import checkpoint


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_saved_checkpoint_loads_back_every_part_of_it(tmp_path):
    model, optimizer = model_and_optimizer(0)
    progress = checkpoint.Progress(epoch=2, global_step=14, best_val_loss=0.5)
    torch.manual_seed(7)
    folder = checkpoint.save(tmp_path / "checkpoint_000014", [(model, optimizer)], progress, sharded=False,
                             device=torch.device("cpu"), extra={"values": {"val_loss": 0.5}})
    after_save = torch.rand(3)  # what the stream draws next, saved with the checkpoint

    other, other_optimizer = model_and_optimizer(1)  # another start: other weights, moments, stream
    got, extra = checkpoint.load(folder, [(other, other_optimizer)], sharded=False, device=torch.device("cpu"))
    assert got == progress and extra == {"values": {"val_loss": 0.5}}
    torch.testing.assert_close(other.state_dict(), model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(other_optimizer.state_dict()["state"], optimizer.state_dict()["state"], rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(3), after_save, rtol=0, atol=0)
    assert checkpoint.latest_checkpoint(tmp_path) == folder


def test_the_progress_file_comes_last_and_a_folder_without_it_is_never_the_latest(tmp_path):
    model, optimizer = model_and_optimizer(0)
    for step in (5, 10):
        checkpoint.save(tmp_path / f"checkpoint_{step:06d}", [(model, optimizer)], checkpoint.Progress(global_step=step),
                        sharded=False, device=torch.device("cpu"), extra={"step": step})
    newest = tmp_path / "checkpoint_000010"
    written = {p.name: p.stat().st_mtime_ns for p in newest.iterdir()}
    assert set(written) == {checkpoint.PROGRESS_FILE, checkpoint.DDP_FILE, checkpoint.RNG_FILE, checkpoint.EXTRA_FILE}
    assert written[checkpoint.PROGRESS_FILE] == max(written.values()), written
    (newest / checkpoint.PROGRESS_FILE).unlink()  # a save cut short before its progress file
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_000005"
