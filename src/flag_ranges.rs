//! Value parsers for the duration, scale and rate flags of every command: each has a range,
//! and a value outside it (`1e300`, `inf`, `NaN`, `1e-300`) is refused by clap with the
//! flag's name and the range, instead of panicking later where a duration is made.

use sim_trace::latency::{MAX_TIME_FACTOR, MAX_TIME_SCALE, MIN_TIME_SCALE, show_number};

/// The longest duration a seconds flag takes: a day.
pub const MAX_SECONDS: f64 = 86_400.0;

fn number(s: &str, what: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .map_err(|_| format!("`{s}` is not {what}"))
}

/// A number of seconds, more than 0 and at most a day.
pub fn seconds(s: &str) -> Result<f64, String> {
    let v = number(s, "a number of seconds")?;
    if v.is_finite() && v > 0.0 && v <= MAX_SECONDS {
        Ok(v)
    } else {
        Err(format!(
            "{s} is out of range: seconds must be more than 0 and at most {MAX_SECONDS} (a day)"
        ))
    }
}

/// A number of seconds from 0 to a day.
pub fn seconds_or_zero(s: &str) -> Result<f64, String> {
    let v = number(s, "a number of seconds")?;
    if v.is_finite() && (0.0..=MAX_SECONDS).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is out of range: seconds must be between 0 and {MAX_SECONDS} (a day)"
        ))
    }
}

/// `--time-scale`: from a thousand times slower to a million times faster.
pub fn time_scale(s: &str) -> Result<f64, String> {
    let v = number(s, "a scale factor")?;
    if v.is_finite() && (MIN_TIME_SCALE..=MAX_TIME_SCALE).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is out of range: the time scale must be between {MIN_TIME_SCALE} and {}",
            show_number(MAX_TIME_SCALE)
        ))
    }
}

/// `--time-factor-under-load`: from 1 (none) to a thousand.
pub fn time_factor(s: &str) -> Result<f64, String> {
    let v = number(s, "a factor")?;
    if v.is_finite() && (1.0..=MAX_TIME_FACTOR).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is out of range: the factor must be between 1 and {MAX_TIME_FACTOR}"
        ))
    }
}

/// The fewest requests per second an arrival-rate flag takes (about one a day).
pub const MIN_RATE: f64 = 1e-5;
/// The most requests per second an arrival-rate flag takes.
pub const MAX_RATE: f64 = 1e6;

/// A request rate per second, from one a day to a million per second.
pub fn rate(s: &str) -> Result<f64, String> {
    let v = number(s, "a rate")?;
    if v.is_finite() && (MIN_RATE..=MAX_RATE).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is out of range: requests per second must be between {} and {}",
            show_number(MIN_RATE),
            show_number(MAX_RATE)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_refuse_the_absurd() {
        for bad in ["1e300", "inf", "NaN", "-1", "0", "abc"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(seconds("600"), Ok(600.0));
        assert_eq!(seconds_or_zero("0"), Ok(0.0));
        assert!(time_scale("1e-300").is_err() && time_scale("100").is_ok());
        assert!(time_factor("0.5").is_err() && time_factor("3").is_ok());
        assert!(rate("1e-300").is_err() && rate("50").is_ok());
    }
}
