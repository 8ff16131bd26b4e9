//! The one way sizes are written on ember's command line: a count of bytes with an optional
//! unit. `K`, `M`, `G` and `KiB`, `MiB`, `GiB` are powers of 1024; `KB`, `MB`, `GB` powers of
//! 1000 (Hugging Face's `max_shard_size` convention); `B` or none is bytes. Case does not
//! matter. So `--sizes 4K` is 4096 bytes and `--max-shard-size 5GB` is 5,000,000,000.

/// Parses a size (see the module doc); `None` for anything else or for 0.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let mult: u64 = match t[digits.len()..].to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KIB" => 1 << 10,
        "M" | "MIB" => 1 << 20,
        "G" | "GIB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return None,
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .and_then(|n| n.checked_mul(mult))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_letters_decimal_byte_units() {
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("1m"), Some(1 << 20));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("5GB"), Some(5_000_000_000));
        assert_eq!(parse_size("500MB"), Some(500_000_000));
        assert_eq!(parse_size("1234"), Some(1234));
        assert_eq!(parse_size("64B"), Some(64));
        assert_eq!(parse_size("0GB"), None);
        assert_eq!(parse_size("5XB"), None);
        assert_eq!(parse_size("K"), None);
    }
}
