"""ProteinGym's masked-marginals over a reference file's assays, as a careful transformers user writes it (the baseline
of the whole-job comparison): `hf_scan.py`'s batched masked copies per assay, one model load for all assays.
usage: python hf_proteingym.py HF_CHECKPOINT_FOLDER DMS_REFERENCE_CSV ASSAY_FOLDER OUT_FOLDER"""
import csv, os, sys
from hf_scan import load, scores

hf, reference, assays, out = sys.argv[1:5]
tok, m = load(hf); os.makedirs(out, exist_ok=True)
for entry in csv.DictReader(open(reference)):
    rows = list(csv.DictReader(open(os.path.join(assays, entry["DMS_filename"]))))
    for row, score in zip(rows, scores(tok, m, entry["target_seq"], [row["mutant"] for row in rows])):
        row["esm2"] = score
    with open(os.path.join(out, entry["DMS_id"] + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0])); w.writeheader(); w.writerows(rows)
