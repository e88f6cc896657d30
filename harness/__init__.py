"""harness -- what makes train.py's runs safe and repeatable, kept off the reading path.

A student reads clip_model.py, dear.py (clustering.py) and data.py, then train.py; train.py calls
this package for everything around the method and the loop, one concern per module:

    cli.py        the command line: flags, choices, help, --recipes (imports no torch)
    config.py     the parsed flags -> a run's settings, checked once (presets, K, ranges, resume)
    devices.py    device, precision, attention kernel, threads, loaders, processes; Runtime
    imagecache.py the few-shot training images decoded once into one buffer; the training order
    splitfiles.py your own folders' reader and split, the few-shot cache on disk
    plan.py       a call's runs (Job), the table rows and their labels
    sources.py    the files a call reads, checked first: CLIP, BPE, role files, description pools,
                  the sentence encoder, fingerprints
    bank.py       the project's labelled description bank and the pool-file reader (data)
    monitor.py    one run's training watched: running sums, the wait for data, the non-finite guard
    files.py      files written whole, folders tried for writing, the file lock (a leaf)
    runfolder.py  the run folder: its lock, checkpoints, resuming, each run's history
    analysis.py   the head analysis as train.py runs it: pool, fingerprint, cache
    probes.py     the rows beside DeAR: CLIP's linear probe, attribute-conditioned retrieval
    reports.py    results.json records, the paper-shaped tables, clusters.md
    pictures.py   roles.png, masks.png, curves.png, retrieval_*.png
    errors.py     TrainError and the one-line errors of train.py's main

Imports run one way: train.py -> harness -> toyworld -> dear.py, data.py, clip_model.py,
clustering.py; toyworld takes its files from files.py, which imports errors.py and clip_model.py
alone; no module here imports train.py (train.py hands its tables over in a cli.RecipeBook);
tests/test_imports.py fails on any import circle.
"""
