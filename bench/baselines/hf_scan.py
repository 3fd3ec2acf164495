"""What a careful transformers user writes to score a deep mutational scan by masked marginals (the baseline of the
whole-job comparison): each mutated position of the wild type masked once, the masked copies batched by a 16,384-token
budget, bf16, sdpa; a mutant's score sums log p(mt) - log p(wt) over its sites (ProteinGym's masked-marginals).
usage: python hf_scan.py HF_CHECKPOINT_FOLDER WILD_TYPE_FASTA MUTANTS_CSV OUT.csv   (MUTANTS_CSV: a `mutant` column)"""
import csv, sys, torch
from transformers import EsmForMaskedLM, EsmTokenizer

def load(hf):
    tok = EsmTokenizer.from_pretrained(hf)
    return tok, EsmForMaskedLM.from_pretrained(hf, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

def masked_log_probs(tok, m, wt, positions, budget=16384):
    """{0-based position: [vocab] float32 log-probabilities with that position masked}."""
    x = tok(wt, return_tensors="pt")["input_ids"].cuda(); per = max(1, budget // x.shape[1]); out = {}
    for a in range(0, len(positions), per):
        pos = torch.tensor(positions[a : a + per], device="cuda") + 1; xb = x.repeat(len(pos), 1)
        xb[torch.arange(len(pos)), pos] = tok.mask_token_id
        with torch.no_grad():
            lp = m(input_ids=xb).logits[torch.arange(len(pos)), pos].float().log_softmax(-1).cpu()
        out.update(zip(positions[a : a + per], lp))
    return out

def scores(tok, m, wt, mutants):
    sites = [[(s[0], int(s[1:-1]) - 1, s[-1]) for s in mutant.split(":")] for mutant in mutants]
    lp = masked_log_probs(tok, m, wt, sorted({p for row in sites for _, p, _ in row}))
    ids = tok.convert_tokens_to_ids
    return [sum((lp[p][ids(b)] - lp[p][ids(a)]).item() for a, p, b in row) for row in sites]

if __name__ == "__main__":
    hf, fasta, mutants_csv, out = sys.argv[1:5]
    tok, m = load(hf)
    wt = "".join(line.strip() for line in open(fasta) if not line.startswith(">"))
    rows = list(csv.DictReader(open(mutants_csv)))
    for row, score in zip(rows, scores(tok, m, wt, [row["mutant"] for row in rows])):
        row["esm2"] = score
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0])); w.writeheader(); w.writerows(rows)
