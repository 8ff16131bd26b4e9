//! Built-in corpora and corpus statistics: Tiny Shakespeare embedded in the binary, and the
//! unigram entropy that a trained model's loss must beat. It deliberately does no
//! downloading: anything bigger is read from disk by the caller.

use std::collections::HashMap;

/// Tiny Shakespeare (Karpathy's char-rnn corpus, ~1.1 MB, public domain), embedded so the
/// default training run and the tests need no network or files.
pub const TINY_SHAKESPEARE: &str = include_str!("../corpus/tinyshakespeare.txt");

/// Entropy in nats of the empirical distribution of `tokens`: `-sum p ln p` with
/// `p = count / total`. A model that ignores context can at best reach this cross-entropy,
/// so a trained GPT's validation loss must come out below it. Returns 0 for no tokens.
pub fn unigram_entropy(tokens: impl IntoIterator<Item = u32>) -> f64 {
    let mut counts: HashMap<u32, u64> = HashMap::new();
    for t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    // Sum in a fixed (sorted) order: HashMap order varies between runs, and a bar used by
    // tests should not wobble in its last bits.
    let mut counts: Vec<u64> = counts.into_values().collect();
    counts.sort_unstable();
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let n = total as f64;
    // -sum (c/n) ln(c/n) = ln n - (1/n) sum c ln c: one log per symbol, and exact (to
    // rounding) ln k for a uniform distribution because ln n - ln c = ln k.
    let sum_c_ln_c: f64 = counts.iter().map(|&c| c as f64 * (c as f64).ln()).sum();
    (n.ln() - sum_c_ln_c / n).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_over_k_symbols_is_ln_k() {
        for k in [1u32, 2, 3, 10, 512, 50257] {
            for reps in [1u32, 7] {
                let tokens = (0..k).flat_map(|s| std::iter::repeat_n(s, reps as usize));
                let h = unigram_entropy(tokens);
                let want = (k as f64).ln();
                assert!((h - want).abs() < 1e-12, "k={k} reps={reps}: {h} vs {want}");
            }
        }
    }

    #[test]
    fn skewed_distribution_matches_formula() {
        // p = (3/4, 1/4)
        let h = unigram_entropy([0, 0, 0, 1]);
        let want = -(0.75f64 * 0.75f64.ln() + 0.25 * 0.25f64.ln());
        assert!((h - want).abs() < 1e-12, "{h} vs {want}");
        assert_eq!(unigram_entropy(std::iter::empty()), 0.0);
    }

    #[test]
    fn corpus_is_embedded() {
        assert_eq!(TINY_SHAKESPEARE.len(), 1_115_394);
        assert!(TINY_SHAKESPEARE.starts_with("First Citizen:"));
    }
}
