"""The loading-memory benchmark at a small size (a ~140 MB MoE, 2 gloo ranks, expert parallel): sharded loading
adds clearly less memory per rank than every rank loading the whole model. Measured on the 2-core machine, load
average 5-7: sharded RSS 157-163 MiB against 249-291 whole, private 84-90 MiB against 122-164 (the whole load's
private peak varies run to run; the sharded one within a few MiB). About 45 s."""
from experiments.benchmarks.load_memory import main


def test_sharded_loading_adds_less_memory_per_rank_than_whole_loading(tmp_path):
    row, = main(["--models", "moe_test", "--worlds", "2", "--layouts", "ep", "--workdir", str(tmp_path)])
    sharded, whole, size = row["sharded"], row["whole"], row["bytes"]
    # both ways every rank ends up holding half the parameters
    assert max(sharded["held"]) == max(whole["held"]) <= size / 2, row
    # RSS: the whole load touches every tensor of the files and copies most of them; a sharded rank half of them
    assert max(sharded["rss"]) < 0.75 * min(whole["rss"]), row
    assert max(sharded["private"]) < min(whole["private"]) - 0.15 * size, row
    assert min(s for mode in ("sharded", "whole") for s in row[mode]["sampled"]) > 0.95, "the sampler missed peaks"
