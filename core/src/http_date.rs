//! HTTP-date parsing (RFC 9110 §5.6.7): IMF-fixdate and the two obsolete forms, as
//! signed Unix seconds, so dates before 1970 are simply in the past.

const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Parses `s` as an HTTP-date; `now` (Unix seconds) resolves RFC 850's two-digit years
/// (a year more than 50 years ahead is in the previous century).
pub(crate) fn parse(s: &str, now: i64) -> Option<i64> {
    if !s.is_ascii() {
        return None;
    }
    imf_fixdate(s)
        .or_else(|| rfc850(s, now))
        .or_else(|| asctime(s))
}

/// `Sun, 06 Nov 1994 08:49:37 GMT`
fn imf_fixdate(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 29 || &s[3..5] != ", " || b[7] != b' ' || b[11] != b' ' || b[16] != b' ' {
        return None;
    }
    if &s[25..] != " GMT" {
        return None;
    }
    let wday = DAYS.iter().position(|d| *d == &s[..3])?;
    let day = digits(&s[5..7])?;
    let month = month(&s[8..11])?;
    let year = digits(&s[12..16])?;
    let t = time(&s[17..25])?;
    assemble(year, month, day, t, wday)
}

/// `Sunday, 06-Nov-94 08:49:37 GMT`
fn rfc850(s: &str, now: i64) -> Option<i64> {
    let (wday_name, rest) = s.split_once(", ")?;
    let wday = LONG_DAYS.iter().position(|d| *d == wday_name)?;
    let b = rest.as_bytes();
    if b.len() != 22 || b[2] != b'-' || b[6] != b'-' || b[9] != b' ' || &rest[18..] != " GMT" {
        return None;
    }
    let day = digits(&rest[..2])?;
    let month = month(&rest[3..6])?;
    let yy = digits(&rest[7..9])?;
    let t = time(&rest[10..18])?;
    let (current, _, _) = civil_from_days(now.div_euclid(86_400));
    let mut year = current - current.rem_euclid(100) + yy;
    if year > current + 50 {
        year -= 100;
    }
    assemble(year, month, day, t, wday)
}

/// `Sun Nov  6 08:49:37 1994`
fn asctime(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 24 || b[3] != b' ' || b[7] != b' ' || b[10] != b' ' || b[19] != b' ' {
        return None;
    }
    let wday = DAYS.iter().position(|d| *d == &s[..3])?;
    let month = month(&s[4..7])?;
    let day = match &s[8..10] {
        d if d.starts_with(' ') => digits(&d[1..])?,
        d => digits(d)?,
    };
    let t = time(&s[11..19])?;
    let year = digits(&s[20..24])?;
    assemble(year, month, day, t, wday)
}

fn digits(s: &str) -> Option<i64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn month(s: &str) -> Option<i64> {
    MONTHS.iter().position(|m| *m == s).map(|m| m as i64 + 1)
}

/// `HH:MM:SS` as seconds of the day (a leap second 60 is accepted as RFC 9110 allows).
fn time(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 8 || b[2] != b':' || b[5] != b':' {
        return None;
    }
    let (h, m, sec) = (digits(&s[..2])?, digits(&s[3..5])?, digits(&s[6..])?);
    (h < 24 && m < 60 && sec <= 60).then_some(h * 3600 + m * 60 + sec)
}

fn assemble(year: i64, month: i64, day: i64, secs: i64, wday: usize) -> Option<i64> {
    if day < 1 || day > days_in_month(year, month) {
        return None;
    }
    let days = days_from_civil(year, month, day);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    if (days + 3).rem_euclid(7) as usize != wday {
        return None;
    }
    // Checked: a two-digit year resolved against an extreme clock can be out of range.
    days.checked_mul(86_400)?.checked_add(secs)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The (year, month, day) of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_round_trips() {
        for z in [-800_000, -1, 0, 1, 59, 60, 10_957, 2_932_896] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(parse("Thu, 01 Jan 1970 00:00:00 GMT", 0), Some(0));
        assert_eq!(
            parse("Fri, 01 Jan 1960 00:00:00 GMT", 0),
            Some(-315_619_200)
        );
    }
}
